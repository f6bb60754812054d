//! gpt-oss (`GptOssForCausalLM`): sliding (window 128) and full attention alternating, biases
//! on every attention projection, a learned sink logit per query head in every softmax, YaRN
//! RoPE, and routed experts on every layer: a router with a bias, the top k of its logits and a
//! softmax over them, experts with biases and the clamped SwiGLU
//! `(clamp(up, ±7) + 1) · g · sigmoid(1.702 · g)`, `g = min(gate, 7)`. transformers saves the
//! experts stacked input-major with gate and up interleaved; the published checkpoints store
//! them as MXFP4 (`*_blocks`, `*_scales`).
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`; q, k, v with biases; RoPE; attention over the window (even
//!    layers by default) or everything, the head's sink joining the softmax; `o_proj` with bias;
//!    `x += h`.
//! 2. `h = post_attention_layernorm(x)`; router logits `(n, experts)` with bias; per token the
//!    top k and `softmax` over them; `x += Σ_e w_e · (down_e(act(gate_up_e(h))) + b)`.

use serde_json::{Map, Value};

use super::{Defaults, ExpertActivation, Family, FfnKind, LLAMA_DEFAULTS, MoeDefaults, Routing};
use crate::arch::{ATTENTION, EMBED_HEAD, GPT_OSS_EXPERTS, O_BIAS, PRE_NORMS, QKV_BIAS, SINKS};
use crate::config::{HfConfig, ModelConfig, raw_f64};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "GptOssForCausalLM",
    model_type: "gpt_oss",
    multimodal: None,
    about: "sliding/full alternation, attention sinks, biased router and experts, clamped SwiGLU, YaRN",
    // GptOssConfig(max_position_embeddings=131072, head_dim=64, default_theta=150000).
    defaults: Defaults {
        max_position_embeddings: 131_072,
        head_dim: Some(64),
        rms_norm_eps: 1e-5,
        rope_theta: 150_000.0,
        ..LLAMA_DEFAULTS
    },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, QKV_BIAS, O_BIAS, SINKS, GPT_OSS_EXPERTS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    // GptOssConfig(attention_bias=True): q, k, v and o carry biases.
    let bias = hf.attention_bias.unwrap_or_else(|| {
        c.defaulted.push("attention_bias".into());
        true
    });
    c.qkv_bias = bias;
    c.o_bias = bias;
    c.decoder.attention_sinks = true;
    // Sliding layers: `layer_types`, else even layers slide; the window defaults to 128.
    let window = if hf.sliding_window_present { super::sliding_window(hf)? } else { Some(128) };
    let n = c.num_layers;
    let windows = match &hf.layer_types {
        Some(types) => super::windows_from_layer_types(types, n, window)?,
        None => (0..n).map(|i| if (i + 1) % 2 != 0 { window } else { None }).collect(),
    };
    for (layer, w) in c.decoder.layers.iter_mut().zip(windows) {
        layer.window = w;
        layer.ffn = FfnKind::Moe;
    }
    // Without `rope_parameters`/`rope_scaling`, transformers' default: YaRN, factor 32 over an
    // original 4096 positions, beta_fast 32, beta_slow 1, no truncation.
    if hf.rope_parameters.is_none() {
        let mut yarn = Map::new();
        yarn.insert("rope_type".into(), Value::from("yarn"));
        yarn.insert("factor".into(), Value::from(32.0));
        yarn.insert("beta_fast".into(), Value::from(32.0));
        yarn.insert("beta_slow".into(), Value::from(1.0));
        yarn.insert("truncate".into(), Value::from(false));
        yarn.insert("original_max_position_embeddings".into(), Value::from(4096));
        c.defaulted.push("rope_parameters".into());
        c.rope = hf.resolve_rope_params(
            &yarn,
            "rope_parameters",
            hf.rope_theta,
            FAMILY.defaults.rope_theta,
            c.max_position_embeddings,
            &mut c.defaulted,
        )?;
    }
    let defaults = MoeDefaults {
        num_experts: 128,
        top_k: 4,
        width_key: "intermediate_size",
        width: c.intermediate_size,
        normalize: None,
    };
    let mut moe = super::moe_fields(hf, c, &defaults)?;
    let mut param = |key: &str, default: f64| -> Result<f64> {
        match raw_f64(hf, key)? {
            Some(v) if v > 0.0 => Ok(v),
            Some(v) => {
                Err(KylinError::config_invalid(format!("config.json field '{key}' is {v}; it must be positive")))
            }
            None => {
                c.defaulted.push(key.to_string());
                Ok(default)
            }
        }
    };
    let alpha = param("swiglu_alpha", 1.702)?;
    let limit = param("swiglu_limit", 7.0)?;
    moe.routing = Routing::TopKSoftmax;
    moe.activation = ExpertActivation::ClampedSwiGlu { alpha, limit };
    moe.router_bias = true;
    moe.expert_bias = true;
    c.decoder.moe = Some(moe);
    Ok(())
}
