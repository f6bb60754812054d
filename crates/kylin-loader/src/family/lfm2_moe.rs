//! LFM2-MoE (`Lfm2MoeForCausalLM`, Liquid AI): LFM2's layers (short convolutions beside
//! attention, per-head q/k norms, every norm a plain RMSNorm with `norm_eps`; see
//! [`super::lfm2`]) whose first `num_dense_layers` keep a dense SwiGLU MLP of
//! `intermediate_size` (no width adjustment, unlike LFM2) and whose other layers have routed
//! experts of `moe_intermediate_size`.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `x += mixer(operator_norm(x))`, the short convolution or attention, as in LFM2.
//! 2. `h = ffn_norm(x)` `(n, hidden)`, then the feed-forward block:
//!    - on the first `num_dense_layers` layers, `w2(silu(w1(h)) · w3(h))`;
//!    - on the others, the experts (transformers' `Lfm2MoeTopKRouter`, in f32):
//!      `s = sigmoid(gate(h))` `(n, experts)`; each token's top `num_experts_per_tok` experts
//!      chosen by `s + expert_bias` when `use_expert_bias` (the bias only selects), by `s`
//!      otherwise; their weights are the chosen `s` alone, divided by `Σ s + 1e-6` when
//!      `norm_topk_prob`, then multiplied by `routed_scaling_factor`;
//!      `Σ_e w_e · w2_e(silu(w1_e(h)) · w3_e(h))`, summed in the order of the experts' indices.
//!
//!    `x += ffn(h)`.
//!
//! Then the final norm (`embedding_norm`) and the head (tied by default).
//!
//! transformers' `Lfm2MoeConfig` has no default `layer_types` (its model cannot be built
//! without them), so a `config.json` that gives neither `layer_types` nor LFM2's
//! `full_attn_idxs` is refused.

use super::{Family, MoeDefaults, Routing};
use crate::arch::{LFM2_ATTENTION, LFM2_EMBED_HEAD, LFM2_MLP, LFM2_MOE, LFM2_NORMS, SHORT_CONV};
use crate::config::{HfConfig, ModelConfig, raw_bool};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "Lfm2MoeForCausalLM",
    model_type: "lfm2_moe",
    multimodal: None,
    about: "LFM2's layers, dense MLPs first, then sigmoid-routed experts with a selection bias",
    // Lfm2MoeConfig's defaults are Lfm2Config's.
    defaults: super::lfm2::LFM2_DEFAULTS,
    resolve,
    tensors: &[LFM2_EMBED_HEAD, LFM2_NORMS, LFM2_ATTENTION, SHORT_CONV, LFM2_MLP, LFM2_MOE],
};

/// `Lfm2MoeConfig`'s expert defaults (`norm_topk_prob=True`).
const MOE: MoeDefaults =
    MoeDefaults { num_experts: 32, top_k: 4, width_key: "moe_intermediate_size", width: 1792, normalize: Some(true) };

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    if hf.layer_types.is_none() && !hf.raw.contains_key("full_attn_idxs") {
        return Err(KylinError::config_invalid(
            "config.json of Lfm2MoeForCausalLM has no layer_types (transformers' Lfm2MoeConfig has no default for it)",
        ));
    }
    super::lfm2::mixers(hf, c)?;
    let mut moe = super::moe_fields(hf, c, &MOE)?;
    let normalize = matches!(moe.routing, Routing::SoftmaxTopK { normalize: true });
    let selection_bias = raw_bool(hf, "use_expert_bias")?.unwrap_or_else(|| {
        c.defaulted.push("use_expert_bias".into());
        true
    });
    let scale = super::routed_scaling_factor(hf, c)?;
    moe.routing =
        Routing::SigmoidTopK { normalize, selection_bias, scale, groups: 1, kept_groups: 1, normalize_epsilon: 1e-6 };
    c.decoder.moe = Some(moe);

    // The first `num_dense_layers` layers keep the dense MLP (Lfm2MoeDecoderLayer).
    super::dense_first_layers(hf, c, "num_dense_layers", 2)
}
