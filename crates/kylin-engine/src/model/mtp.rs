//! The forward pass of a multi-token-prediction head ([`kylin_loader::mtp`]): the input
//! projection in front of a one-layer decoder that shares the target's embedding and head.
//!
//! For each position of a pass, with `t` the token that follows it and `g` a hidden row (the
//! target's final-normed hidden state there, or the head's own output for further proposals):
//!
//! ```text
//! cat (n, 2 · hidden) = [pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(g)]
//! x   (n, hidden)     = cat · fcᵀ                        fc: (hidden, 2 · hidden)
//! y   (rows, hidden)  = norm(layer(x)) for the logits rows; logits (rows, vocab) = y · headᵀ
//! ```

use kylin_kernels::{self as kernels, ThreadPool};
use kylin_loader::Result;

use super::linear::{Linear, Matmul, Norm};
use super::{BatchPlan, Model, Scratch};
use crate::kv_pool::KvPool;
use crate::rope::Ropes;

/// An MTP head ready to run: its one-layer decoder and its input projection.
pub struct MtpHead {
    /// One full-attention layer; its final norm is `mtp.norm`, its embedding and head the
    /// target's (views of the same bytes).
    model: Model,
    /// `[hidden, 2 · hidden]`.
    fc: Linear,
    norm_embedding: Norm,
    norm_hidden: Norm,
}

impl std::fmt::Debug for MtpHead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MtpHead").field("dims", self.model.dims()).finish()
    }
}

/// The activations of the head's passes: the decoder's, and the projection's input
/// `(max_tokens, 2 · hidden)`.
#[derive(Debug)]
pub struct MtpScratch {
    scratch: Scratch,
    cat: Vec<f32>,
}

impl MtpScratch {
    /// Touches every buffer once, so that the first pass does not fault its pages in.
    pub fn prefault(&mut self) {
        self.scratch.prefault();
        self.cat.fill(0.0);
    }
}

impl MtpHead {
    /// Binds the head's weights, checking every shape against its configuration.
    pub fn new(head: &kylin_loader::mtp::MtpHead) -> Result<Self> {
        let mut model = Model::new(&head.config, &head.weights)?;
        // Its head is the target's, shared once both are prepared (`share_lm_head`).
        model.head_from_target = true;
        let hidden = head.config.hidden_size;
        let kind = head.config.decoder.norm;
        Ok(MtpHead {
            fc: Linear::new(&head.fc, None, hidden, 2 * hidden)?,
            norm_embedding: Norm::new(&head.pre_fc_norm_embedding, hidden, kind)?,
            norm_hidden: Norm::new(&head.pre_fc_norm_hidden, hidden, kind)?,
            model,
        })
    }

    /// The head's one-layer decoder (its dimensions, KV groups and RoPE).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The head's decoder, to quantize it or choose its precision as the target's.
    pub fn model_mut(&mut self) -> &mut Model {
        &mut self.model
    }

    /// Computes the head's logits with `target`'s head (the same matrix, quantized or
    /// prepared as the target's), instead of a copy of its own: with `--quantize` the planes are
    /// shared, not made and held twice. Call once both are prepared alike.
    pub fn share_lm_head(&mut self, target: &Model) {
        debug_assert!(self.model.lm_head.weight.same_bytes(&target.lm_head.weight));
        self.model.lm_head = target.lm_head.clone();
    }

    /// Whether the head's logits are computed with `target`'s own quantized planes.
    #[cfg(test)]
    pub(crate) fn shares_quantized_lm_head(&self, target: &Model) -> bool {
        use super::linear::QuantSource;
        match (&self.model.lm_head.quant, &target.lm_head.quant) {
            (Some(QuantSource::Owned(a)), Some(QuantSource::Owned(b))) => std::sync::Arc::ptr_eq(a, b),
            _ => false,
        }
    }

    /// The buffers of passes of up to `max_tokens` tokens in `max_segments` segments over
    /// sequences of up to `context` positions.
    pub fn plan_scratch(&self, max_tokens: usize, max_segments: usize, context: usize) -> Result<MtpScratch> {
        let scratch = self.model.plan_scratch(max_tokens, max_segments, context)?;
        let cat = vec![0.0; max_tokens.saturating_mul(2 * self.model.dims.hidden)];
        Ok(MtpScratch { scratch, cat })
    }

    /// One pass over `plan`, whose ids are the tokens that follow each position, with `hidden`
    /// `(n, hidden)` the hidden row of each (in the plan's token order): appends each
    /// position's keys and values to its blocks in `kv` and computes the logits and output
    /// rows of the segments that want them ([`MtpHead::logits`], [`MtpHead::output`]).
    ///
    /// The caller guarantees what [`Model::forward`] asks (the plan within the scratch's
    /// sizes, ids inside the vocabulary, block tables covering every position). Allocates
    /// nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        pool: &ThreadPool,
        kv: &mut KvPool,
        rope: &mut Ropes,
        s: &mut MtpScratch,
        plan: &BatchPlan,
        hidden: &[f32],
    ) {
        let d = self.model.dims();
        let (h, n) = (d.hidden, plan.tokens());
        assert!(n <= s.scratch.max_tokens && hidden.len() >= n * h, "MTP pass larger than planned");
        let end = plan.segments.iter().map(|seg| seg.start + seg.n).max().unwrap_or(0);
        rope.prepare(0, end);
        // cat (n, 2 · hidden): each row's normed embedding, then its normed hidden row.
        let embed = self.model.embed.matrix();
        let tmp = &mut s.scratch.xn[..h];
        for ((&id, row), g) in plan.ids.iter().zip(s.cat.chunks_exact_mut(2 * h)).zip(hidden.chunks_exact(h)) {
            let (e, hid) = row.split_at_mut(h);
            kernels::widen_row(embed, id as usize, tmp);
            self.norm_embedding.apply(tmp, d.eps, e);
            self.norm_hidden.apply(g, d.eps, hid);
        }
        // x (n, hidden) = cat (n, 2 · hidden) · fcᵀ (2 · hidden, hidden).
        let mm = Matmul { pool, bf16: self.model.bf16 };
        self.fc.forward(mm, &s.cat[..n * 2 * h], n, &mut s.scratch.x[..n * h], &mut s.scratch.products);
        self.model.forward_embedded(pool, kv, None, None, rope, &mut s.scratch, plan, None);
    }

    /// The logits of row `row` of the last pass, `(vocab)`.
    pub fn logits<'a>(&self, s: &'a MtpScratch, row: usize) -> &'a [f32] {
        s.scratch.logits(row, self.model.dims().vocab)
    }

    /// The head's output hidden row (after `mtp.norm`) of logits row `row` of the last pass,
    /// `(hidden)`: the hidden row of the next proposal's position.
    pub fn output<'a>(&self, s: &'a MtpScratch, row: usize) -> &'a [f32] {
        let h = self.model.dims().hidden;
        &s.scratch.logit_hidden[row * h..(row + 1) * h]
    }
}

impl Model {
    /// The final-normed hidden state of token `t` of the last pass (the input an MTP head
    /// reads), `out (hidden)`: the residual stream's row after the last layer, through the
    /// final norm. The scratch must keep every row ([`Scratch::keep_every_hidden_row`]).
    pub fn final_hidden(&self, s: &Scratch, t: usize, out: &mut [f32]) {
        debug_assert!(s.keep_hidden, "final_hidden on a scratch that keeps only the logits rows");
        let h = self.dims.hidden;
        self.final_norm.apply(&s.x[t * h..(t + 1) * h], self.dims.eps, out);
    }
}
