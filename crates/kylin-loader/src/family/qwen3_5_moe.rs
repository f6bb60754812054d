//! Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, the text model; `model_type` `qwen3_5_moe_text`; and
//! the language model of `Qwen3_5MoeForConditionalGeneration`, the layout it is published in):
//! Qwen3.5's layers (Gated DeltaNet on three of every four, gated full attention on the fourth;
//! see [`super::qwen3_5`]) with a Mixture-of-Experts block in place of every layer's MLP.
//!
//! The feed-forward block, `h = post_attention_layernorm(x)` `(n, hidden)`: router logits
//! `(n, experts)`, a softmax over every expert, the top `num_experts_per_tok` always
//! renormalised to sum to one (transformers' `Qwen3_5MoeTopKRouter` has no `norm_topk_prob`);
//! `x += Σ_e w_e · down_e(silu(gate_e(h)) · up_e(h)) + sigmoid(shared_expert_gate(h)) ·
//! shared_expert(h)`, the routed sum taken in the order of the experts' indices, then the
//! shared part added, as Qwen2-MoE does.

use super::{Defaults, Family, FfnKind, LLAMA_DEFAULTS, MoeDefaults};
use crate::arch::{
    DELTA_NET_PROJECTIONS, EMBED_HEAD, GATED_ATTENTION, GATED_DELTA_NET, MLP_EXPERTS, MLP_ROUTER, PRE_NORMS,
    SHARED_EXPERT,
};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Qwen3_5MoeForCausalLM",
    model_type: "qwen3_5_moe_text",
    multimodal: Some("Qwen3_5MoeForConditionalGeneration"),
    about: "Qwen3.5's hybrid layers with softmax top-k experts and a sigmoid-gated shared expert",
    // Qwen3_5MoeTextConfig(head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6); it
    // has no `intermediate_size` (every layer is sparse), and published configs leave it out.
    defaults: Defaults {
        max_position_embeddings: 32768,
        head_dim: Some(256),
        intermediate_size: Some(0),
        ..LLAMA_DEFAULTS
    },
    resolve,
    tensors: &[
        EMBED_HEAD,
        PRE_NORMS,
        GATED_ATTENTION,
        DELTA_NET_PROJECTIONS,
        GATED_DELTA_NET,
        MLP_ROUTER,
        MLP_EXPERTS,
        SHARED_EXPERT,
    ],
};

/// `Qwen3_5MoeTextConfig`'s expert defaults; the top k are always renormalised.
const MOE: MoeDefaults =
    MoeDefaults { num_experts: 256, top_k: 8, width_key: "moe_intermediate_size", width: 512, normalize: None };

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    super::qwen3_5::resolve(hf, c)?;
    let mut moe = super::moe_fields(hf, c, &MOE)?;
    let shared = super::shared_expert_width(hf, c, "Qwen3.5-MoE", 512)?;
    moe.shared_intermediate = Some(shared);
    c.decoder.moe = Some(moe);
    // Every layer's feed-forward block is the sparse one (Qwen3_5MoeDecoderLayer).
    for layer in &mut c.decoder.layers {
        layer.ffn = FfnKind::Moe;
    }
    Ok(())
}
