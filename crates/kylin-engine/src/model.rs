//! The decoder-only transformer shared by Qwen3, Qwen2, Llama and Mistral.
//!
//! One block serves every supported architecture: pre-norm attention with grouped KV heads and
//! rotate-half RoPE, then a SwiGLU MLP, with the per-architecture choices (q/k/v and output
//! biases, MLP biases, Qwen3's per-head q/k RMSNorm, tied or separate head, RoPE scaling) made
//! once in [`Model::new`] as `Option` fields and precomputed tables.
//!
//! Guarantees:
//! - Weights are read in place, in their stored dtype (BF16, F16 or F32); nothing is copied.
//! - Every shape is checked in [`Model::new`]; the forward pass never re-checks or branches on a
//!   format.
//! - All run-time memory ([`State`]: KV cache, RoPE tables, activations) is planned by
//!   [`Model::plan`] from the configuration, the context size and the largest prefill chunk;
//!   [`Model::decode`] allocates nothing.
//! - Compute is float32 in the same order of operations as transformers' eager float32 path.

use kylin_kernels::{self as kernels, ThreadPool, WeightDType, WeightMatrix, WeightVector};
use kylin_loader::{DType, KylinError, LayerWeights, ModelConfig, ModelWeights, Result, RopeConfig, WeightTensor};

use crate::kv_cache::KvCache;
use crate::rope::Rope;

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
}

/// A linear layer `y = x · Wᵀ (+ b)` with `W` stored `[rows, cols]` (`[out, in]`).
#[derive(Debug, Clone)]
struct Linear {
    weight: WeightTensor,
    dtype: WeightDType,
    rows: usize,
    cols: usize,
    bias: Option<Vector>,
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
        })
    }

    #[inline]
    fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix { dtype: self.dtype, rows: self.rows, cols: self.cols, data: self.weight.bytes() }
    }

    /// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows) (+ b)`.
    #[inline]
    fn forward(&self, pool: &ThreadPool, x: &[f32], n: usize, y: &mut [f32]) {
        kernels::matmul(pool, self.matrix(), x, n, y);
        if let Some(bias) = &self.bias {
            for row in y.chunks_exact_mut(self.rows) {
                kernels::add_bias(row, bias.view());
            }
        }
    }

    /// Several linear layers over the same input in one pool job:
    /// `y_i (n, rows_i) = x (n, cols) · W_iᵀ (cols, rows_i) (+ b_i)`.
    #[inline]
    fn forward_many<const N: usize>(pool: &ThreadPool, x: &[f32], n: usize, mut layers: [(&Linear, &mut [f32]); N]) {
        let mut mats: [(WeightMatrix<'_>, &mut [f32]); N] = layers.each_mut().map(|(l, y)| (l.matrix(), &mut **y));
        kernels::matmul_many(pool, x, n, &mut mats);
        for (l, y) in layers.iter_mut() {
            if let Some(bias) = &l.bias {
                for row in y.chunks_exact_mut(l.rows) {
                    kernels::add_bias(row, bias.view());
                }
            }
        }
    }

    fn element_count(&self) -> u64 {
        self.weight.element_count() as u64 + self.bias.as_ref().map_or(0, |b| b.tensor.element_count() as u64)
    }

    fn byte_len(&self) -> u64 {
        self.weight.byte_len() as u64 + self.bias.as_ref().map_or(0, |b| b.tensor.byte_len() as u64)
    }
}

/// One decoder layer with the architecture's choices already made.
#[derive(Debug, Clone)]
struct Layer {
    attn_norm: Vector,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    /// Qwen3's per-head RMSNorm on q and k before RoPE, `(head_dim)` each.
    q_norm: Option<Vector>,
    k_norm: Option<Vector>,
    mlp_norm: Vector,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

impl Layer {
    fn new(w: &LayerWeights, d: &Dims) -> Result<Self> {
        let (hidden, q_dim, kv_dim) = (d.hidden, d.q_dim(), d.kv_dim());
        Ok(Layer {
            attn_norm: Vector::new(&w.attn_norm, hidden)?,
            q_proj: Linear::new(&w.q_proj, w.q_bias.as_ref(), q_dim, hidden)?,
            k_proj: Linear::new(&w.k_proj, w.k_bias.as_ref(), kv_dim, hidden)?,
            v_proj: Linear::new(&w.v_proj, w.v_bias.as_ref(), kv_dim, hidden)?,
            o_proj: Linear::new(&w.o_proj, w.o_bias.as_ref(), hidden, q_dim)?,
            q_norm: Vector::optional(w.q_norm.as_ref(), d.head_dim)?,
            k_norm: Vector::optional(w.k_norm.as_ref(), d.head_dim)?,
            mlp_norm: Vector::new(&w.mlp_norm, hidden)?,
            gate_proj: Linear::new(&w.gate_proj, w.gate_bias.as_ref(), d.intermediate, hidden)?,
            up_proj: Linear::new(&w.up_proj, w.up_bias.as_ref(), d.intermediate, hidden)?,
            down_proj: Linear::new(&w.down_proj, w.down_bias.as_ref(), hidden, d.intermediate)?,
        })
    }

    fn linears(&self) -> [&Linear; 7] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj, &self.gate_proj, &self.up_proj, &self.down_proj]
    }

    fn vectors(&self) -> impl Iterator<Item = &Vector> {
        [Some(&self.attn_norm), Some(&self.mlp_norm), self.q_norm.as_ref(), self.k_norm.as_ref()].into_iter().flatten()
    }
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

/// Which logits a forward call produces.
enum Logits<'a> {
    /// None (an inner prefill chunk).
    Skip,
    /// The last position's row, into [`State`]'s logits buffer.
    Last,
    /// Every position's row, `(n, vocab)`, into the given slice.
    All(&'a mut [f32]),
}

/// Activation buffers for up to `max_tokens` positions per forward call.
#[derive(Debug)]
struct Scratch {
    max_tokens: usize,
    /// Residual stream, `(max_tokens, hidden)`.
    x: Vec<f32>,
    /// Normalised input of a block, `(max_tokens, hidden)`.
    xn: Vec<f32>,
    /// Queries, `(max_tokens, n_heads * head_dim)`.
    q: Vec<f32>,
    /// Keys and values of the chunk, `(max_tokens, n_kv_heads * head_dim)`.
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention output, `(max_tokens, n_heads * head_dim)`.
    attn: Vec<f32>,
    /// Block output before the residual add, `(max_tokens, hidden)`.
    proj: Vec<f32>,
    /// MLP gate and up projections, `(max_tokens, intermediate)`.
    gate: Vec<f32>,
    up: Vec<f32>,
    /// One score row per query head, `(n_heads, context)`.
    scores: Vec<f32>,
    /// One head for the in-place q/k norm, `(head_dim)`.
    head_tmp: Vec<f32>,
    /// The final-normed last position, `(hidden)`.
    last_hidden: Vec<f32>,
    /// Logits of the last position, `(vocab)`.
    logits: Vec<f32>,
}

/// Everything a sequence needs at run time, planned once: KV cache, RoPE tables, activations.
#[derive(Debug)]
pub struct State {
    rope: Rope,
    cache: KvCache,
    scratch: Scratch,
    /// Tokens in the cache.
    position: usize,
}

impl State {
    /// Tokens currently in the KV cache.
    pub fn position(&self) -> usize {
        self.position
    }

    /// Maximum number of tokens the cache holds.
    pub fn capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Forgets the sequence (the cache contents are overwritten as new tokens arrive).
    pub fn reset(&mut self) {
        self.position = 0;
    }

    /// Keeps the first `len` cached tokens and forgets the rest (no-op if fewer are cached).
    pub fn truncate(&mut self, len: usize) {
        self.position = self.position.min(len);
    }

    /// Bytes of the KV cache.
    pub fn kv_cache_bytes(&self) -> usize {
        self.cache.bytes()
    }
}

/// A `*mut f32` buffer that pool tasks write disjoint parts of.
#[derive(Clone, Copy)]
struct SharedMut {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: a `SharedMut` is only built from a `&mut [f32]` that outlives the pool run using it,
// and every task only forms slices that no other task forms (see `slice`).
unsafe impl Send for SharedMut {}
// SAFETY: as above; shared access only hands out disjoint sub-slices.
unsafe impl Sync for SharedMut {}

impl SharedMut {
    fn new(buffer: &mut [f32]) -> Self {
        SharedMut { ptr: buffer.as_mut_ptr(), len: buffer.len() }
    }

    /// `len` elements from `start`.
    ///
    /// # Safety
    /// No two slices obtained from the same buffer may be alive at the same time and overlap,
    /// and the buffer must outlive them.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start <= self.len && len <= self.len - start, "SharedMut slice out of bounds");
        // SAFETY: in bounds (checked above); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// The transformer: weights bound by role, with the architecture's choices made.
#[derive(Debug, Clone)]
pub struct Model {
    dims: Dims,
    rope_config: RopeConfig,
    max_position_embeddings: usize,
    /// `[vocab, hidden]`, rows widened to f32 on lookup.
    embed: Linear,
    layers: Vec<Layer>,
    final_norm: Vector,
    /// `[vocab, hidden]`; the embedding's bytes when tied.
    lm_head: Linear,
    tied: bool,
}

impl Model {
    /// Binds the weights, checking every shape and dtype against the configuration.
    pub fn new(config: &ModelConfig, weights: &ModelWeights) -> Result<Self> {
        if config.num_heads == 0 || config.num_kv_heads == 0 || config.num_heads % config.num_kv_heads != 0 {
            return Err(KylinError::config_invalid(format!(
                "num_attention_heads ({}) must be a non-zero multiple of num_key_value_heads ({})",
                config.num_heads, config.num_kv_heads
            )));
        }
        if weights.layers.len() != config.num_layers {
            return Err(KylinError::config_invalid(format!(
                "num_hidden_layers is {} but {} layers were bound",
                config.num_layers,
                weights.layers.len()
            )));
        }
        if config.hidden_act != "silu" {
            return Err(KylinError::operator_unsupported(format!(
                "hidden_act '{}' is not supported; the native engine implements 'silu' (SwiGLU)",
                config.hidden_act
            )));
        }
        let dims = Dims {
            hidden: config.hidden_size,
            n_layers: config.num_layers,
            n_heads: config.num_heads,
            n_kv_heads: config.num_kv_heads,
            head_dim: config.head_dim,
            intermediate: config.intermediate_size,
            vocab: config.vocab_size,
            eps: config.rms_norm_eps as f32,
            attn_scale: (config.head_dim as f64).powf(-0.5) as f32,
        };
        let layers = weights.layers.iter().map(|w| Layer::new(w, &dims)).collect::<Result<Vec<_>>>()?;
        Ok(Model {
            dims,
            rope_config: config.rope.clone(),
            max_position_embeddings: config.max_position_embeddings,
            embed: Linear::new(&weights.embed_tokens, None, dims.vocab, dims.hidden)?,
            layers,
            final_norm: Vector::new(&weights.final_norm, dims.hidden)?,
            lm_head: Linear::new(&weights.lm_head, None, dims.vocab, dims.hidden)?,
            tied: weights.lm_head.same_bytes(&weights.embed_tokens),
        })
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
                l.linears().iter().map(|m| m.element_count()).sum::<u64>()
                    + l.vectors().map(|v| v.tensor.element_count() as u64).sum::<u64>()
            })
            .sum();
        let head = if self.tied { 0 } else { self.lm_head.element_count() };
        self.embed.element_count() + layers + self.final_norm.tensor.element_count() as u64 + head
    }

    /// Bytes of weights read to produce one token: every matrix and vector once, the head once,
    /// and one embedding row.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                l.linears().iter().map(|m| m.byte_len()).sum::<u64>()
                    + l.vectors().map(|v| v.tensor.byte_len() as u64).sum::<u64>()
            })
            .sum();
        let embed_row = (self.dims.hidden * self.embed.dtype.size_in_bytes()) as u64;
        layers + self.final_norm.tensor.byte_len() as u64 + self.lm_head.byte_len() + embed_row
    }

    /// Plans all run-time memory for `context` positions and prefill chunks of up to `max_chunk`
    /// tokens. `CONFIG_INVALID` if a size overflows.
    pub fn plan(&self, context: usize, max_chunk: usize) -> Result<State> {
        let d = &self.dims;
        let max_tokens = max_chunk.clamp(1, context.max(1));
        let sized = |rows: usize, cols: usize, what: &str| -> Result<Vec<f32>> {
            let len = rows.checked_mul(cols).ok_or_else(|| {
                KylinError::config_invalid(format!(
                    "{what} buffer of {rows} x {cols} overflows; pass a smaller --ctx-size"
                ))
            })?;
            Ok(vec![0.0; len])
        };
        let scratch = Scratch {
            max_tokens,
            x: sized(max_tokens, d.hidden, "residual")?,
            xn: sized(max_tokens, d.hidden, "norm")?,
            q: sized(max_tokens, d.q_dim(), "query")?,
            k: sized(max_tokens, d.kv_dim(), "key")?,
            v: sized(max_tokens, d.kv_dim(), "value")?,
            attn: sized(max_tokens, d.q_dim(), "attention")?,
            proj: sized(max_tokens, d.hidden, "projection")?,
            gate: sized(max_tokens, d.intermediate, "gate")?,
            up: sized(max_tokens, d.intermediate, "up")?,
            scores: sized(d.n_heads, context, "attention score")?,
            head_tmp: sized(1, d.head_dim, "head")?,
            last_hidden: sized(1, d.hidden, "hidden")?,
            logits: sized(1, d.vocab, "logits")?,
        };
        Ok(State {
            rope: Rope::new(&self.rope_config, d.head_dim, context)?,
            cache: KvCache::new(d.n_layers, d.n_kv_heads, d.head_dim, context)?,
            scratch,
            position: 0,
        })
    }

    /// Checks that `ids` are valid token ids and fit after the cached tokens: `INPUT_INVALID`
    /// for no ids or an id outside the vocabulary, `CONTEXT_OVERFLOW` if they do not fit.
    pub fn check_input(&self, state: &State, ids: &[u32]) -> Result<()> {
        if ids.is_empty() {
            return Err(KylinError::input_invalid("prefill needs at least one token id; got none"));
        }
        let capacity = state.capacity();
        let needed = state.position.saturating_add(ids.len());
        if needed > capacity {
            return Err(KylinError::context_overflow(format!(
                "{} tokens after {} cached need a context of {needed} positions, but the context size is {capacity}; \
                 pass a larger --ctx-size (the model supports up to {})",
                ids.len(),
                state.position,
                self.max_position_embeddings
            )));
        }
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.dims.vocab) {
            return Err(KylinError::input_invalid(format!(
                "token id {bad} is outside the model's vocabulary of {} ids",
                self.dims.vocab
            )));
        }
        Ok(())
    }

    /// Appends `ids` to the sequence (in chunks of the planned size) and returns the logits of
    /// the last one, `(vocab)`.
    pub fn prefill<'s>(&self, pool: &ThreadPool, state: &'s mut State, ids: &[u32]) -> Result<&'s [f32]> {
        self.check_input(state, ids)?;
        // RoPE sees the whole call at once, as transformers does for a single forward.
        state.rope.prepare(state.position, state.position + ids.len());
        let chunk = state.scratch.max_tokens;
        let n_chunks = ids.len().div_ceil(chunk);
        for (i, part) in ids.chunks(chunk).enumerate() {
            let logits = if i + 1 == n_chunks { Logits::Last } else { Logits::Skip };
            self.forward(pool, state, part, logits);
        }
        Ok(&state.scratch.logits)
    }

    /// Appends `ids` and writes the logits of every position into `out`, `(ids.len(), vocab)`.
    /// `INPUT_INVALID` if `out` has the wrong length.
    pub fn prefill_all_logits(&self, pool: &ThreadPool, state: &mut State, ids: &[u32], out: &mut [f32]) -> Result<()> {
        self.check_input(state, ids)?;
        if out.len() != ids.len() * self.dims.vocab {
            return Err(KylinError::input_invalid(format!(
                "logits buffer holds {} values; expected {} tokens x {} vocab",
                out.len(),
                ids.len(),
                self.dims.vocab
            )));
        }
        state.rope.prepare(state.position, state.position + ids.len());
        let chunk = state.scratch.max_tokens;
        for (part, rows) in ids.chunks(chunk).zip(out.chunks_mut(chunk * self.dims.vocab)) {
            self.forward(pool, state, part, Logits::All(rows));
        }
        Ok(())
    }

    /// Appends one token and returns its logits, `(vocab)`. Allocates nothing.
    pub fn decode<'s>(&self, pool: &ThreadPool, state: &'s mut State, id: u32) -> Result<&'s [f32]> {
        let ids = std::slice::from_ref(&id);
        self.check_input(state, ids)?;
        state.rope.prepare(state.position, state.position + 1);
        self.forward(pool, state, ids, Logits::Last);
        Ok(&state.scratch.logits)
    }

    /// One forward call over `ids` at positions `position..position + n`, `n <= max_tokens`,
    /// with the RoPE rows already prepared. Appends to the KV cache.
    fn forward(&self, pool: &ThreadPool, state: &mut State, ids: &[u32], logits: Logits<'_>) {
        let d = &self.dims;
        let n = ids.len();
        let start = state.position;
        let h = d.hidden;

        // 1. Embedding lookup: ids (n) -> x (n, hidden).
        let embed = self.embed.matrix();
        for (&id, row) in ids.iter().zip(state.scratch.x.chunks_exact_mut(h)) {
            kernels::widen_row(embed, id as usize, row);
        }

        // 2. The decoder layers, each updating the residual stream x (n, hidden) in place.
        for (index, layer) in self.layers.iter().enumerate() {
            self.attention_block(pool, layer, index, state, start, n);
            self.mlp_block(pool, layer, &mut state.scratch, n);
        }
        state.position = start + n;

        // 3. Final norm and head, only for the rows whose logits are wanted.
        let s = &mut state.scratch;
        let norm = self.final_norm.view();
        match logits {
            Logits::Skip => {}
            Logits::Last => {
                // x[n - 1] (hidden) -> last_hidden (hidden) -> logits (1, vocab).
                kernels::rms_norm(&s.x[(n - 1) * h..n * h], norm, d.eps, &mut s.last_hidden);
                self.lm_head.forward(pool, &s.last_hidden, 1, &mut s.logits);
            }
            Logits::All(out) => {
                // x (n, hidden) -> xn (n, hidden) -> out (n, vocab).
                for (x, xn) in s.x[..n * h].chunks_exact(h).zip(s.xn.chunks_exact_mut(h)) {
                    kernels::rms_norm(x, norm, d.eps, xn);
                }
                self.lm_head.forward(pool, &s.xn[..n * h], n, out);
            }
        }
    }

    /// Pre-norm self-attention with grouped KV heads: `x += o_proj(attention(rope(q), rope(k), v))`.
    fn attention_block(
        &self,
        pool: &ThreadPool,
        layer: &Layer,
        index: usize,
        state: &mut State,
        start: usize,
        n: usize,
    ) {
        let d = &self.dims;
        let (h, hd, q_dim, kv_dim) = (d.hidden, d.head_dim, d.q_dim(), d.kv_dim());
        let State { rope, cache, scratch: s, .. } = state;

        // 1. RMSNorm: x (n, hidden) -> xn (n, hidden).
        let norm = layer.attn_norm.view();
        for (x, xn) in s.x[..n * h].chunks_exact(h).zip(s.xn.chunks_exact_mut(h)) {
            kernels::rms_norm(x, norm, d.eps, xn);
        }

        // 2. Projections: xn (n, hidden) -> q (n, n_heads * head_dim), k and v (n, n_kv_heads * head_dim).
        Linear::forward_many(
            pool,
            &s.xn[..n * h],
            n,
            [
                (&layer.q_proj, &mut s.q[..n * q_dim]),
                (&layer.k_proj, &mut s.k[..n * kv_dim]),
                (&layer.v_proj, &mut s.v[..n * kv_dim]),
            ],
        );

        // 3. Per-head RMSNorm (Qwen3), then RoPE, on every (token, head) row of q and k,
        //    viewed as (n, heads, head_dim).
        let tmp = &mut s.head_tmp;
        for (qk, head_norm) in [(&mut s.q[..n * q_dim], &layer.q_norm), (&mut s.k[..n * kv_dim], &layer.k_norm)] {
            let heads_per_token = qk.len() / (n * hd);
            for (row, head) in qk.chunks_exact_mut(hd).enumerate() {
                if let Some(w) = head_norm {
                    tmp.copy_from_slice(head);
                    kernels::rms_norm(tmp, w.view(), d.eps, head);
                }
                let pos = start + row / heads_per_token;
                kernels::rope_rotate_half(head, rope.cos(pos), rope.sin(pos));
            }
        }

        // 4. Append k and v to the cache: (n, n_kv_heads, head_dim) -> (n_kv_heads, position, head_dim).
        cache.store(index, start, &s.k[..n * kv_dim], &s.v[..n * kv_dim]);

        // 5. Causal attention, one pool task per KV head and its group of query heads, so each
        //    head's cached keys and values are read once per token while they are in cache:
        //    query t of head h attends to positions 0..=start + t of KV head h / group.
        //    q (n, n_heads, head_dim) -> attn (n, n_heads, head_dim).
        let cache: &KvCache = cache;
        let context = cache.capacity();
        let total = start + n;
        let group = d.group();
        let scale = d.attn_scale;
        let q = &s.q[..n * q_dim];
        let attn = SharedMut::new(&mut s.attn[..n * q_dim]);
        let scores = SharedMut::new(&mut s.scores);
        pool.run(d.n_kv_heads, &|kv_head| {
            let keys = cache.keys(index, kv_head, total);
            let values = cache.values(index, kv_head, total);
            for t in 0..n {
                for head in kv_head * group..(kv_head + 1) * group {
                    // SAFETY: score row `head` and the (t, head) block of attn belong to the
                    // query heads of `kv_head`, which only this task touches.
                    let (scores, out) =
                        unsafe { (scores.slice(head * context, context), attn.slice(t * q_dim + head * hd, hd)) };
                    let offset = t * q_dim + head * hd;
                    kernels::attention_head(
                        &q[offset..offset + hd],
                        keys,
                        values,
                        start + t + 1,
                        hd,
                        scale,
                        scores,
                        out,
                    );
                }
            }
        });

        // 6. Output projection and residual: attn (n, n_heads * head_dim) -> proj (n, hidden); x += proj.
        layer.o_proj.forward(pool, &s.attn[..n * q_dim], n, &mut s.proj[..n * h]);
        kernels::add_assign(&mut s.x[..n * h], &s.proj[..n * h]);
    }

    /// Pre-norm SwiGLU MLP: `x += down_proj(silu(gate_proj(xn)) * up_proj(xn))`.
    fn mlp_block(&self, pool: &ThreadPool, layer: &Layer, s: &mut Scratch, n: usize) {
        let d = &self.dims;
        let (h, i) = (d.hidden, d.intermediate);

        // 1. RMSNorm: x (n, hidden) -> xn (n, hidden).
        let norm = layer.mlp_norm.view();
        for (x, xn) in s.x[..n * h].chunks_exact(h).zip(s.xn.chunks_exact_mut(h)) {
            kernels::rms_norm(x, norm, d.eps, xn);
        }

        // 2. gate and up: xn (n, hidden) -> (n, intermediate) each; gate = silu(gate) * up.
        Linear::forward_many(
            pool,
            &s.xn[..n * h],
            n,
            [(&layer.gate_proj, &mut s.gate[..n * i]), (&layer.up_proj, &mut s.up[..n * i])],
        );
        kernels::silu_mul(&mut s.gate[..n * i], &s.up[..n * i]);

        // 3. down and residual: gate (n, intermediate) -> proj (n, hidden); x += proj.
        layer.down_proj.forward(pool, &s.gate[..n * i], n, &mut s.proj[..n * h]);
        kernels::add_assign(&mut s.x[..n * h], &s.proj[..n * h]);
    }
}
