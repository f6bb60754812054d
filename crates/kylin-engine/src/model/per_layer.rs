//! Gemma 4's per-layer inputs: a second embedding and a projection of the first give each token
//! a vector per layer, which each layer mixes into its residual stream after its MLP.

use kylin_kernels::{self as kernels};
use kylin_loader::arch::Role;
use kylin_loader::family::{NormKind, PerLayerInput};
use kylin_loader::{KylinError, ModelWeights, Result};

use super::linear::{Linear, Matmul, Norm};
use super::scratch::ProductScratch;
use super::scratch::Scratch;
use super::{Dims, Step};

/// Gemma 4's per-layer input block of one layer: after the MLP,
/// `x += post_norm(projection(gelu_tanh(gate(x)) · p))` with `p` the layer's input.
#[derive(Debug, Clone)]
pub(super) struct PerLayerBlock {
    /// `[width, hidden]`.
    pub(super) gate: Linear,
    /// `[hidden, width]`.
    pub(super) projection: Linear,
    pub(super) post_norm: Norm,
}

/// Gemma 4's per-layer inputs: for each token, `layers · width` values computed before the
/// layers from a second embedding and a projection of the first.
#[derive(Debug, Clone)]
pub(super) struct PerLayerInputs {
    /// `embed_tokens_per_layer`, `[vocab, layers · width]`, rows widened on lookup.
    pub(super) embed: Linear,
    /// `per_layer_model_projection`, `[layers · width, hidden]`.
    pub(super) projection: Linear,
    /// `per_layer_projection_norm`, `[width]`.
    pub(super) norm: Norm,
    pub(super) width: usize,
    /// Rows of `embed`: ids at or past it (an image's tokens) take row `pad_row`'s values.
    vocab: usize,
    /// The text model's `pad_token_id`.
    pad_row: usize,
    /// `√width` (the second embedding's scale), `hidden^-0.5` (the projection's) and `2^-0.5`
    /// (the sum's), as the f32 numbers transformers multiplies by.
    embed_scale: f32,
    projection_scale: f32,
    sum_scale: f32,
}

impl PerLayerInputs {
    pub(super) fn new(weights: &ModelWeights, spec: PerLayerInput, d: &Dims, kind: NormKind) -> Result<Self> {
        let PerLayerInput { width, vocab, pad_row } = spec;
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
            pad_row,
            embed_scale: (width as f64).sqrt() as f32,
            projection_scale: (d.hidden as f64).powf(-0.5) as f32,
            sum_scale: 2f64.powf(-0.5) as f32,
        })
    }

    /// Every token's inputs for every layer: `e (n, hidden)` (the scaled embedding) ->
    /// `out (n, layers · width)`, each `(width)` chunk
    /// `(rmsnorm(projection(e) · hidden^-0.5) + embed_per_layer(id) · √width) · 2^-0.5`;
    /// `row (layers · width)` is scratch.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compute(
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
            // An image's tokens (ids past the vocabulary) take the pad token's row, as
            // transformers' `Gemma4Model` does (`pad_token_id`, 0 in every published config).
            let id = if (id as usize) < self.vocab { id as usize } else { self.pad_row };
            kernels::widen_row(embed, id, row);
            kernels::scale(row, self.embed_scale);
            kernels::add_assign(projected, row);
            kernels::scale(projected, self.sum_scale);
        }
    }
}

impl PerLayerBlock {
    /// Binds layer `index`'s block for inputs of `width`.
    pub(super) fn new(
        w: &kylin_loader::LayerWeights,
        index: usize,
        hidden: usize,
        width: usize,
        kind: NormKind,
        weights: &ModelWeights,
    ) -> Result<Self> {
        Ok(PerLayerBlock {
            gate: Linear::bind(w.require(Role::PerLayerGate, index)?, None, width, hidden, weights)?,
            projection: Linear::bind(w.require(Role::PerLayerProjection, index)?, None, hidden, width, weights)?,
            post_norm: Norm::new(w.require(Role::PostPerLayerNorm, index)?, hidden, kind)?,
        })
    }

    /// Layer `i`'s block: `proj (n, hidden) = post_norm(projection(gelu_tanh(gate(x)) · ple_i))`,
    /// normed into `xn`, for the residual add.
    pub(super) fn forward(&self, c: &Step<'_>, i: usize, s: &mut Scratch, n: usize) {
        let h = c.hidden;
        let w = self.gate.rows;
        let all = s.ple.len() / s.max_tokens.max(1);
        // 1. gate: x (n, hidden) -> g (n, width); g = gelu_tanh(g) · ple[:, i] per token.
        self.gate.forward(c.mm, &s.x[..n * h], n, &mut s.ple_gate[..n * w], &mut s.products);
        for (t, g) in s.ple_gate[..n * w].chunks_exact_mut(w).enumerate() {
            let input = &s.ple[t * all + i * w..t * all + (i + 1) * w];
            kernels::gelu_tanh_mul(g, input);
        }
        // 2. projection: g (n, width) -> proj (n, hidden) -> xn = post_norm(proj).
        self.projection.forward(c.mm, &s.ple_gate[..n * w], n, &mut s.proj[..n * h], &mut s.products);
        self.post_norm.rows(c.mm.pool, &s.proj[..n * h], h, c.eps, &mut s.xn[..n * h]);
    }
}
