//! Qwen3-Next (`Qwen3NextForCausalLM`): Qwen3.5-MoE's decoder before Qwen3.5 (Gated DeltaNet
//! on three of every four layers, `layer_types` else `full_attention_interval`; gated full
//! attention on the fourth; see [`super::qwen3_5`]), with experts and a sigmoid-gated shared
//! expert on the layers Qwen's sparse rule picks (`decoder_sparse_step`, `mlp_only_layers`),
//! a dense MLP of `intermediate_size` on the others. Every RMSNorm but DeltaNet's gated one
//! scales by `1 + w` (transformers' `Qwen3NextRMSNorm`, weights stored as offsets from 0); the
//! gated one by `w`. The attention gate is laid out as in Qwen3.5: `q_proj` gives each head
//! its `head_dim` queries, then its `head_dim` gate values.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`, then the mixer:
//!    - linear attention: `in_proj_qkvz(h)` `(n, 2 · key_dim + 2 · value_dim)` and
//!      `in_proj_ba(h)` `(n, 2 · value_heads)`, both grouped per key head (transformers'
//!      `fix_query_key_value_ordering`): key head `g`'s slice of the first is its query
//!      `(key_head_dim)`, its key `(key_head_dim)`, then the values and the gates `z` of its
//!      `r = value_heads / key_heads` value heads `(r · value_head_dim)` each; of the second,
//!      the `b` then the `a` of those value heads `(r)` each. Gathered into Qwen3.5's layout
//!      (all queries, all keys, all values; `z`; `b`; `a`), the rest is Qwen3.5's: the causal
//!      `conv1d` and SiLU, q and k L2-normalised (q scaled by `key_head_dim^-½`),
//!      `β = sigmoid(b)`, `g = -exp(A_log) · softplus(a + dt_bias)`, the gated delta rule,
//!      per value head `rmsnorm(o) · w · silu(z)`, `out_proj` → `(n, hidden)`;
//!    - full attention: Qwen3.5's gated attention (per-head `q_norm`/`k_norm`, RoPE on the first
//!      `partial_rotary_factor` (0.25) of each head, `· sigmoid(gate)`, `o_proj`);
//!
//!    `x += mixer(h)`.
//! 2. `h = post_attention_layernorm(x)`; on a sparse layer, router logits `(n, experts)`, a
//!    softmax over every expert, the top `num_experts_per_tok`, renormalised when
//!    `norm_topk_prob` (the default); `x += Σ_e w_e · expert_e(h) + sigmoid(shared_expert_gate(h))
//!    · shared_expert(h)`, the routed sum in the order of the experts' indices; on a dense
//!    layer `x += mlp(h)`.
//!
//! The grouped projections are read as stored (zero copy): the engine runs each as one matrix
//! product and then gathers the output columns into Qwen3.5's layout, a copy of
//! `2 · key_dim + 2 · value_dim + 2 · value_heads` floats per token
//! (`kylin_engine`'s `delta_net.rs`). Of the other choices, a load-time row gather would hold
//! owned copies of the projections in place of views of the map and could not gather the
//! rows of a quantized or published matrix without decoding it, and a strided read inside the
//! product kernels would give every kernel a layout of its own.

use super::{Defaults, Family, LLAMA_DEFAULTS, MoeDefaults};
use crate::arch::{
    DELTA_NET_GROUPED_PROJECTIONS, EMBED_HEAD, GATED_ATTENTION, GATED_DELTA_NET, MLP, MLP_EXPERTS, MLP_ROUTER,
    PRE_NORMS, SHARED_EXPERT,
};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Qwen3NextForCausalLM",
    model_type: "qwen3_next",
    multimodal: None,
    about: "Gated DeltaNet with fused qkvz/ba projections grouped per key head, gated attention, experts with a shared expert",
    // Qwen3NextConfig(head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6).
    defaults: Defaults { max_position_embeddings: 32768, head_dim: Some(256), ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[
        EMBED_HEAD,
        PRE_NORMS,
        GATED_ATTENTION,
        DELTA_NET_GROUPED_PROJECTIONS,
        GATED_DELTA_NET,
        MLP,
        MLP_ROUTER,
        MLP_EXPERTS,
        SHARED_EXPERT,
    ],
};

/// `Qwen3NextConfig`'s expert defaults (`norm_topk_prob=True`).
const MOE: MoeDefaults =
    MoeDefaults { num_experts: 512, top_k: 10, width_key: "moe_intermediate_size", width: 512, normalize: Some(true) };

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    super::qwen3_5::resolve_named(hf, c, "Qwen3-Next")?;
    if let Some(linear) = &mut c.decoder.linear_attention {
        linear.grouped_projections = true;
    }
    let mut moe = super::moe_fields(hf, c, &MOE)?;
    moe.shared_intermediate = Some(super::shared_expert_width(hf, c, "Qwen3-Next", 512)?);
    c.decoder.moe = Some(moe);
    super::qwen_sparse_layers(hf, c)
}
