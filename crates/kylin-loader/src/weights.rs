//! The bound model: every weight the engine needs, by role, checked against the config.

use crate::tensor::WeightTensor;

/// One decoder layer. Shapes are `[out_features, in_features]` as HF `nn.Linear` stores them.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// `input_layernorm.weight`: `[hidden]`.
    pub attn_norm: WeightTensor,
    /// `[num_heads * head_dim, hidden]`.
    pub q_proj: WeightTensor,
    /// `[num_kv_heads * head_dim, hidden]`.
    pub k_proj: WeightTensor,
    /// `[num_kv_heads * head_dim, hidden]`.
    pub v_proj: WeightTensor,
    /// `[hidden, num_heads * head_dim]`.
    pub o_proj: WeightTensor,
    pub q_bias: Option<WeightTensor>,
    pub k_bias: Option<WeightTensor>,
    pub v_bias: Option<WeightTensor>,
    pub o_bias: Option<WeightTensor>,
    /// Qwen3 per-head norms: `[head_dim]`.
    pub q_norm: Option<WeightTensor>,
    pub k_norm: Option<WeightTensor>,
    /// `post_attention_layernorm.weight`: `[hidden]`.
    pub mlp_norm: WeightTensor,
    /// `[intermediate, hidden]`.
    pub gate_proj: WeightTensor,
    /// `[intermediate, hidden]`.
    pub up_proj: WeightTensor,
    /// `[hidden, intermediate]`.
    pub down_proj: WeightTensor,
    pub gate_bias: Option<WeightTensor>,
    pub up_bias: Option<WeightTensor>,
    pub down_bias: Option<WeightTensor>,
}

/// How the output head was bound, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HeadBinding {
    /// The head uses the embedding matrix.
    pub tied: bool,
    /// A sentence for `inspect`, e.g. "tie_word_embeddings is true; lm_head.weight is present
    /// but ignored, as transformers does".
    pub reason: String,
}

/// All weights of a decoder-only transformer.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed_tokens: WeightTensor,
    /// `[hidden]`.
    pub final_norm: WeightTensor,
    /// `[vocab, hidden]`; the same bytes as `embed_tokens` when tied.
    pub lm_head: WeightTensor,
    pub head: HeadBinding,
    pub layers: Vec<LayerWeights>,
    /// For a quantized checkpoint (`ModelConfig::quantization`): each quantized matrix's
    /// `weight_scale` plane, keyed by its weight tensor's name.
    pub scales: std::collections::BTreeMap<String, WeightTensor>,
    /// For a published quantized checkpoint (`ModelConfig::published`): each quantized
    /// matrix's checked tensors, keyed by the name its role's float weight would have
    /// (`model.layers.0.self_attn.q_proj.weight`). The role's own tensor is then the matrix's
    /// stored values (`weight`, `weight_packed` or `qweight`), not a float `[rows, cols]`.
    pub published: std::collections::BTreeMap<String, crate::published::PublishedMatrix>,
}

impl ModelWeights {
    /// The published quantized matrix whose stored values are `t` (a role's tensor), if any.
    pub fn published_matrix(&self, t: &WeightTensor) -> Option<&crate::published::PublishedMatrix> {
        self.published.values().find(|m| m.values.same_bytes(t))
    }

    /// The matrices of the matrix products: every layer's seven projections, then the head
    /// (the embedding's bytes when tied).
    pub fn matrices(&self) -> impl Iterator<Item = &WeightTensor> {
        self.layers
            .iter()
            .flat_map(|l| [&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj])
            .chain(std::iter::once(&self.lm_head))
    }

    /// Every bound tensor once (a tied head is the embedding, listed once).
    pub fn tensors(&self) -> Vec<&WeightTensor> {
        let mut out = vec![&self.embed_tokens, &self.final_norm];
        if !self.head.tied {
            out.push(&self.lm_head);
        }
        for l in &self.layers {
            out.extend([&l.attn_norm, &l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.mlp_norm]);
            out.extend([&l.gate_proj, &l.up_proj, &l.down_proj]);
            let optional = [&l.q_bias, &l.k_bias, &l.v_bias, &l.o_bias, &l.q_norm, &l.k_norm];
            out.extend(optional.into_iter().chain([&l.gate_bias, &l.up_bias, &l.down_bias]).flatten());
        }
        out
    }
}
