//! GLM-4.5 (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7): grouped-query
//! attention with q/k/v biases and optional per-head q/k norms, half of each head rotated,
//! dense MLPs on the first `first_k_dense_replace` layers, then DeepSeek-V3's sigmoid router
//! with a selection bias and group-limited choice, and a shared expert without a gate.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`; `q = q_proj(h) + b_q` `(n, heads · head_dim)`, k and v likewise
//!    `(n, kv_heads · head_dim)`; per-head `q_norm`/`k_norm` when `use_qk_norm`; RoPE on the
//!    first `partial_rotary_factor` (0.5) of each head (rotate-half within it); causal
//!    attention; `x += o_proj(·)` (no bias).
//! 2. `h = post_attention_layernorm(x)`; on the first `first_k_dense_replace` layers
//!    `x += down(silu(gate(h)) · up(h))` of `intermediate_size`; on the others, in f32
//!    (transformers' `Glm4MoeTopkRouter`): `s = sigmoid(gate(h))` `(n, experts)`; a group's
//!    score is the sum of the two best `s + e_score_correction_bias` among its
//!    `experts / n_group` experts; the best `topk_group` groups stay; the top
//!    `num_experts_per_tok` of `s + bias` among their experts are chosen; their weights are the
//!    chosen `s`, divided by `Σ + 1e-20` when `norm_topk_prob`, times `routed_scaling_factor`;
//!    `x += Σ_e w_e · down_e(silu(gate_e(h)) · up_e(h))` (in the order of the experts'
//!    indices) `+ shared_experts(h)` (width `n_shared_experts · moe_intermediate_size`).
//!
//! Then `norm` and `lm_head`. Every norm is a plain RMSNorm (`rms_norm_eps`, 1e-5).
//!
//! The checkpoint's `num_nextn_predict_layers` NextN layers (`model.layers.{L}.*` from
//! `L = num_hidden_layers` on: `eh_proj`, `enorm`, `hnorm`, `shared_head.norm` and one sparse
//! decoder layer) are the multi-token-prediction head that `--mtp` proposes with
//! ([`crate::mtp`]); transformers' forward ignores them.

use super::{Defaults, Family, LLAMA_DEFAULTS, MAX_EXPERT_GROUPS, MoeDefaults, QkNorm, Routing};
use crate::arch::{
    ATTENTION, EMBED_HEAD, GLM4_MOE_ROUTER, HEAD_QK_NORM, MLP, MLP_EXPERTS, PRE_NORMS, QKV_BIAS, SHARED_EXPERTS,
};
use crate::config::{HfConfig, ModelConfig, raw_bool, raw_u64};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "Glm4MoeForCausalLM",
    model_type: "glm4_moe",
    multimodal: None,
    about: "q/k/v biases, half-rotary heads, dense first layers, sigmoid group-limited router with a selection bias, ungated shared expert, NextN layers",
    // Glm4MoeConfig: max_position_embeddings=131072, rms_norm_eps=1e-5.
    defaults: Defaults { max_position_embeddings: 131072, rms_norm_eps: 1e-5, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[
        EMBED_HEAD,
        PRE_NORMS,
        ATTENTION,
        QKV_BIAS,
        HEAD_QK_NORM,
        MLP,
        GLM4_MOE_ROUTER,
        MLP_EXPERTS,
        SHARED_EXPERTS,
    ],
};

/// `Glm4MoeConfig`'s expert defaults (`n_routed_experts=128`, `num_experts_per_tok=8`,
/// `moe_intermediate_size=1408`, `norm_topk_prob=True`).
const MOE: MoeDefaults =
    MoeDefaults { num_experts: 128, top_k: 8, width_key: "moe_intermediate_size", width: 1408, normalize: Some(true) };

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    // Glm4MoeAttention: q, k and v carry biases when `attention_bias`; o_proj never does.
    hf.attention_bias_or_default(c);
    c.o_bias = false;
    let qk_norm = raw_bool(hf, "use_qk_norm")?.unwrap_or_else(|| {
        c.defaulted.push("use_qk_norm".into());
        false
    });
    c.decoder.qk_norm = if qk_norm { QkNorm::PerHead } else { QkNorm::None };
    super::default_partial_rotary(hf, c, 0.5);

    let mut moe = super::moe_fields(hf, c, &MOE)?;
    let normalize = matches!(moe.routing, Routing::SoftmaxTopK { normalize: true });
    let positive = |key: &str, default: u64, c: &mut ModelConfig| -> Result<usize> {
        match raw_u64(hf, key)? {
            Some(0) => {
                Err(KylinError::config_invalid(format!("config.json field '{key}' is 0; it must be at least 1")))
            }
            Some(v) => Ok(v as usize),
            None => {
                c.defaulted.push(key.to_string());
                Ok(default as usize)
            }
        }
    };
    let groups = positive("n_group", 1, c)?;
    let kept_groups = positive("topk_group", 1, c)?;
    let experts = moe.num_experts;
    if groups > MAX_EXPERT_GROUPS || !experts.is_multiple_of(groups) || kept_groups > groups {
        return Err(KylinError::config_invalid(format!(
            "config.json fields 'n_group' ({groups}) and 'topk_group' ({kept_groups}): the {experts} experts must split \
             into n_group equal groups (at most {MAX_EXPERT_GROUPS}) and topk_group must not exceed n_group"
        )));
    }
    if groups > 1 && experts / groups < 2 {
        return Err(KylinError::config_invalid(format!(
            "config.json field 'n_group' is {groups}: each group scores by its two best experts, so a group needs at \
             least two of the {experts}"
        )));
    }
    if moe.top_k > kept_groups * (experts / groups) {
        return Err(KylinError::config_invalid(format!(
            "config.json: num_experts_per_tok={} exceeds the {} experts of the topk_group={kept_groups} groups kept",
            moe.top_k,
            kept_groups * (experts / groups)
        )));
    }
    let scale = super::routed_scaling_factor(hf, c)?;
    moe.routing =
        Routing::SigmoidTopK { normalize, selection_bias: true, scale, groups, kept_groups, normalize_epsilon: 1e-20 };
    // `n_shared_experts` shared experts, as one MLP of their summed width (0: none).
    let shared = match raw_u64(hf, "n_shared_experts")? {
        Some(n) => n as usize,
        None => {
            c.defaulted.push("n_shared_experts".into());
            1
        }
    };
    if shared > 64 {
        return Err(KylinError::config_invalid(format!(
            "config.json field 'n_shared_experts' is {shared}; Kylin runs at most 64"
        )));
    }
    moe.shared_intermediate = (shared > 0).then_some(shared * moe.intermediate);
    moe.shared_gated = false;
    c.decoder.moe = Some(moe);

    // The first `first_k_dense_replace` layers keep the dense MLP of `intermediate_size`.
    super::dense_first_layers(hf, c, "first_k_dense_replace", 1)
}
