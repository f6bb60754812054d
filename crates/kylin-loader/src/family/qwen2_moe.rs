//! Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases) with routed experts and
//! a shared expert whose output is gated by `sigmoid(shared_expert_gate(h))`.
//!
//! The feed-forward block, `h = post_attention_layernorm(x)` `(n, hidden)`:
//! `x += Σ_e w_e · expert_e(h) + sigmoid(shared_expert_gate(h)) · shared_expert(h)`, the routed
//! sum taken in the order of the experts' indices, then the shared part added.

use super::{Defaults, Family, LLAMA_DEFAULTS, MoeDefaults};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, MLP_EXPERTS, MLP_ROUTER, PRE_NORMS, QKV_BIAS, SHARED_EXPERT};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Qwen2MoeForCausalLM",
    model_type: "qwen2_moe",
    multimodal: None,
    about: "Qwen2 attention, routed experts and a sigmoid-gated shared expert",
    defaults: Defaults { max_position_embeddings: 32768, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS, MLP_ROUTER, MLP_EXPERTS, SHARED_EXPERT],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    // Qwen2MoeConfig(qkv_bias=True): q, k and v carry biases; o_proj and the MLPs do not.
    c.qkv_bias = crate::config::raw_bool(hf, "qkv_bias")?.unwrap_or(true);
    super::qwen2::sliding_layers(hf, c)?;
    let defaults = MoeDefaults {
        num_experts: 60,
        top_k: 4,
        width_key: "moe_intermediate_size",
        width: 1408,
        normalize: Some(false),
    };
    let mut moe = super::moe_fields(hf, c, &defaults)?;
    let shared = super::shared_expert_width(hf, c, "Qwen2-MoE", 5632)?;
    moe.shared_intermediate = Some(shared);
    c.decoder.moe = Some(moe);
    super::qwen_sparse_layers(hf, c)
}
