//! The activation buffers of one forward pass, planned once (`Model::plan_scratch`).

use kylin_kernels::paged::PartialStats;

/// Activation buffers for up to `max_tokens` tokens and `max_segments` segments per forward
/// pass over sequences of up to `context` positions.
#[derive(Debug)]
pub struct Scratch {
    pub(super) max_tokens: usize,
    pub(super) max_segments: usize,
    /// Rows of `logits`: one per segment, plus the rows planned for segments that want every
    /// token's logits.
    pub(super) max_logit_rows: usize,
    /// Every token's final hidden row is read after a pass (an MTP head reads them through
    /// [`super::Model::final_hidden`]), so the last layer computes every row, not only the rows
    /// whose logits are wanted.
    pub(super) keep_hidden: bool,
    /// Rows the last layer computed output for in the last pass.
    pub(super) last_layer_rows: usize,
    /// Residual stream, `(max_tokens, hidden)`.
    pub(super) x: Vec<f32>,
    /// Normalised input of a block, `(max_tokens, hidden)`.
    pub(super) xn: Vec<f32>,
    /// Queries, `(max_tokens, n_heads * head_dim)`.
    pub(super) q: Vec<f32>,
    /// Keys and values of the batch, `(max_tokens, n_kv_heads * head_dim)`.
    pub(super) k: Vec<f32>,
    pub(super) v: Vec<f32>,
    /// Attention output, `(max_tokens, n_heads * head_dim)`.
    pub(super) attn: Vec<f32>,
    /// Block output before the residual add, `(max_tokens, hidden)`.
    pub(super) proj: Vec<f32>,
    /// MLP gate and up projections, `(max_tokens, intermediate)`.
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    /// First attention task of each segment, and the total, `(max_segments + 1)`.
    pub(super) attention_tasks: Vec<usize>,
    /// Split-K decode: at most this many segments of a step are split, each over at most
    /// `split_parts` partitions.
    pub(super) split_segments: usize,
    pub(super) split_parts: usize,
    /// Their undivided outputs, `(split_segments, n_heads, split_parts, head_dim)`, and states,
    /// `(split_segments, n_heads, split_parts)`.
    pub(super) split_outputs: Vec<f32>,
    pub(super) split_stats: Vec<PartialStats>,
    /// One head (or, for a norm over the whole projection, one token's queries) for the
    /// in-place q/k norm, `(max(head_dim, n_heads * head_dim))`.
    pub(super) head_tmp: Vec<f32>,
    /// One token's multimodal rotary cos then sin, `(head_dim)`.
    pub(super) rope_tmp: Vec<f32>,
    /// Final-normed rows whose logits are wanted, `(max_logit_rows, hidden)`.
    pub(super) logit_hidden: Vec<f32>,
    /// Their logits, `(max_logit_rows, vocab)`.
    pub(super) logits: Vec<f32>,
    /// Gemma 4's per-layer inputs, `(max_tokens, layers · width)`, one token's row of the
    /// second embedding, `(layers · width)`, and a layer's gate, `(max_tokens, width)` (empty
    /// for other families).
    pub(super) ple: Vec<f32>,
    pub(super) ple_row: Vec<f32>,
    pub(super) ple_gate: Vec<f32>,
    /// The routed experts' tables and activations (empty without experts).
    pub(super) moe: super::MoeScratch,
    /// A gated attention's q_proj output, `(max_tokens, n_heads, 2 · head_dim)` (empty without
    /// gated attention layers).
    pub(super) q_gate: Vec<f32>,
    /// The recurrent mixers' buffers (empty without them): the input projection
    /// `(max_tokens, max(2 · key_dim + value_dim, 3 · hidden))`, the convolution's input or
    /// output `(max_tokens, max(conv_dim, hidden))`, the output gate `(max_tokens,
    /// max(value_dim, hidden))`, DeltaNet's raw b and a `(2, max_tokens, value_heads)` and its
    /// β and g `(max_tokens, 2 · value_heads)`, its outputs head-major `(value_heads,
    /// max_tokens, value_head_dim)` (or the convolution's `(max_tokens, hidden)`), one head's
    /// normed output `(value_head_dim)`.
    pub(super) lin_in: Vec<f32>,
    pub(super) lin_mixed: Vec<f32>,
    pub(super) lin_z: Vec<f32>,
    pub(super) lin_gates: Vec<f32>,
    pub(super) lin_beta: Vec<f32>,
    pub(super) lin_core: Vec<f32>,
    pub(super) lin_tmp: Vec<f32>,
    /// Qwen3-Next's grouped projections before their columns are gathered, `(max_tokens,
    /// conv_dim + value_dim + 2 · value_heads)` (empty for every other model).
    pub(super) lin_grouped: Vec<f32>,
    /// The quantized or rounded activations of one matrix product.
    pub(super) products: ProductScratch,
}

/// The activations of one matrix product in the form its kernels read.
#[derive(Debug, Default)]
pub struct ProductScratch {
    /// BF16 activations (`Precision::Bf16` only; else empty).
    pub(super) xb: Vec<u16>,
    /// Int8 activations with their block scales (quantized models only; else empty).
    pub(super) xq: Vec<u8>,
    /// The input of a product quantized as a published scheme says, `(max_tokens, widest)`
    /// (`--precision f32` on a checkpoint whose scheme quantizes activations; else empty).
    pub(super) xa: Vec<f32>,
}

impl Scratch {
    pub fn max_tokens(&self) -> usize {
        self.max_tokens
    }

    /// Keeps every token's final hidden row after each pass, for [`super::Model::final_hidden`]
    /// (by default the last layer computes only the rows whose logits are wanted).
    pub fn keep_every_hidden_row(&mut self) {
        self.keep_hidden = true;
    }

    /// Rows the last layer computed output for in the last pass: every token's, or only the
    /// rows whose logits were wanted.
    pub fn last_layer_rows(&self) -> usize {
        self.last_layer_rows
    }

    /// Logits rows one forward pass can fill.
    pub fn max_logit_rows(&self) -> usize {
        self.max_logit_rows
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
            + self.rope_tmp.len()
            + self.logit_hidden.len()
            + self.logits.len()
            + self.ple.len()
            + self.ple_row.len()
            + self.ple_gate.len()
            + self.moe.elements()
            + self.q_gate.len()
            + self.lin_in.len()
            + self.lin_mixed.len()
            + self.lin_z.len()
            + self.lin_gates.len()
            + self.lin_beta.len()
            + self.lin_core.len()
            + self.lin_tmp.len()
            + self.lin_grouped.len()
            + self.split_outputs.len()
            + 2 * self.split_stats.len();
        (elements * std::mem::size_of::<f32>()
            + self.products.xb.len() * std::mem::size_of::<u16>()
            + self.products.xq.len()
            + self.products.xa.len() * std::mem::size_of::<f32>()) as u64
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
            &mut self.q_gate,
            &mut self.lin_in,
            &mut self.lin_mixed,
            &mut self.lin_z,
            &mut self.lin_gates,
            &mut self.lin_beta,
            &mut self.lin_core,
            &mut self.lin_grouped,
            &mut self.split_outputs,
            &mut self.products.xa,
        ]
        .into_iter()
        .chain(self.moe.buffers_mut())
        {
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

    /// The final-normed hidden state `(hidden)` of logits row `row` of the last forward pass.
    pub fn logit_hidden(&self, row: usize, hidden: usize) -> &[f32] {
        &self.logit_hidden[row * hidden..(row + 1) * hidden]
    }

    /// Logits row `row` of the last forward pass, `(vocab)`.
    pub fn logits(&self, row: usize, vocab: usize) -> &[f32] {
        &self.logits[row * vocab..(row + 1) * vocab]
    }
}
