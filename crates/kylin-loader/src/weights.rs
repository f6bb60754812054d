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
}
