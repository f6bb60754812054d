//! Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k norms) with routed
//! experts in place of the MLP on the sparse layers (`decoder_sparse_step`, `mlp_only_layers`):
//! a softmax router over every expert, the top `num_experts_per_tok`, renormalised when
//! `norm_topk_prob`, SwiGLU experts.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`; q, k, v; per-head q/k norms; RoPE; attention; `o_proj`; `x += h`.
//! 2. `h = post_attention_layernorm(x)`; router logits `(n, experts)`; per token its top k
//!    experts and weights; `x += Σ_e w_e · down_e(silu(gate_e(h)) · up_e(h))`, summed in the
//!    order of the experts' indices (or the dense MLP on `mlp_only_layers`).

use super::{Defaults, Family, LLAMA_DEFAULTS, MoeDefaults, QkNorm};
use crate::arch::{ATTENTION, EMBED_HEAD, HEAD_QK_NORM, MLP, MLP_EXPERTS, MLP_ROUTER, O_BIAS, PRE_NORMS, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Qwen3MoeForCausalLM",
    model_type: "qwen3_moe",
    multimodal: None,
    about: "Qwen3 attention, softmax top-k experts (norm_topk_prob), sparse layers by step",
    // Qwen3MoeConfig(max_position_embeddings=32768).
    defaults: Defaults { max_position_embeddings: 32768, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS, HEAD_QK_NORM, MLP_ROUTER, MLP_EXPERTS],
};

/// `Qwen3MoeConfig`'s expert defaults.
pub(crate) const MOE: MoeDefaults =
    MoeDefaults { num_experts: 128, top_k: 8, width_key: "moe_intermediate_size", width: 768, normalize: Some(false) };

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.attention_bias_or_default(c);
    c.decoder.qk_norm = QkNorm::PerHead;
    super::qwen2::sliding_layers(hf, c)?;
    c.decoder.moe = Some(super::moe_fields(hf, c, &MOE)?);
    super::qwen_sparse_layers(hf, c)
}
