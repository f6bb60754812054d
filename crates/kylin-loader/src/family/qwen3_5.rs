//! Qwen3.5 (`Qwen3_5ForCausalLM`, the text model; `model_type` `qwen3_5_text`; and the language
//! model of `Qwen3_5ForConditionalGeneration`, which is how Qwen3.5 is published: `text_config`
//! nested in `config.json`, weights under `model.language_model.*`, a vision tower beside
//! them and `mtp.*` multi-token-prediction tensors: the tower runs through `vision.rs`, the
//! head only as the proposer of speculative decoding, bound by `crate::mtp` when asked).
//!
//! Three of every four layers (`layer_types`, else `full_attention_interval`) are Gated
//! DeltaNet linear attention, the fourth gated full attention; every layer has a dense SwiGLU
//! MLP. Every RMSNorm but DeltaNet's gated one scales by `1 + w`.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`, then the mixer:
//!    - linear attention: `in_proj_qkv(h)` `(n, 2 · key_dim + value_dim)` through the causal
//!      depthwise `conv1d` (state: the last `kernel - 1` rows) and SiLU, split into q, k
//!      (L2-normalised per key head, q scaled by `key_head_dim^-½`) and v; `β = sigmoid(in_proj_b(h))`,
//!      `g = -exp(A_log) · softplus(in_proj_a(h) + dt_bias)` per value head; the gated delta
//!      rule (state: `(key_head_dim, value_head_dim)` per value head); per value head
//!      `rmsnorm(o) · w · silu(in_proj_z(h))`; `out_proj` → `(n, hidden)`;
//!    - full attention: `q_proj(h)` gives per head `head_dim` queries and `head_dim` gate values;
//!      per-head `q_norm`/`k_norm`, RoPE on the first `partial_rotary_factor` (0.25) of each
//!      head (the multimodal sections, `mrope_section`, all take the text position), attention,
//!      `· sigmoid(gate)`, `o_proj`;
//!
//!    `x += mixer(h)`.
//! 2. `x += mlp(post_attention_layernorm(x))`.

use super::{Defaults, Family, LLAMA_DEFAULTS, LinearAttention, MixerKind, NormKind, QkNorm};
use crate::arch::{DELTA_NET_PROJECTIONS, EMBED_HEAD, GATED_ATTENTION, GATED_DELTA_NET, MLP, PRE_NORMS};
use crate::config::{HfConfig, ModelConfig, raw_bool, raw_u64};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "Qwen3_5ForCausalLM",
    model_type: "qwen3_5_text",
    multimodal: Some("Qwen3_5ForConditionalGeneration"),
    about: "Gated DeltaNet linear attention on 3 of 4 layers, gated full attention, partial rotary",
    // Qwen3_5TextConfig(head_dim=256, max_position_embeddings=32768, rms_norm_eps=1e-6).
    defaults: Defaults { max_position_embeddings: 32768, head_dim: Some(256), ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, GATED_ATTENTION, DELTA_NET_PROJECTIONS, GATED_DELTA_NET, MLP],
};

/// The largest head width and convolution the linear-attention kernels take
/// (`kylin_kernels::delta::{MAX_DIM, MAX_CONV_KERNEL}`; the loader does not depend on the
/// kernels, so it restates them to refuse at load what the engine could not run).
pub(crate) const MAX_LINEAR_HEAD_DIM: usize = 256;
pub(crate) const MAX_CONV_KERNEL: usize = 16;

pub(crate) fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    resolve_named(hf, c, "Qwen3.5")
}

/// Qwen3.5's decoder, with `family` naming the model in messages (Qwen3-Next shares it).
pub(crate) fn resolve_named(hf: &HfConfig, c: &mut ModelConfig, family: &str) -> Result<()> {
    hf.silu_only(c)?;
    if hf.attention_bias == Some(true) {
        return Err(KylinError::operator_unsupported(format!(
            "config.json sets attention_bias; Kylin's {family} block has no attention biases (no published {family} uses them)"
        )));
    }
    if raw_bool(hf, "attn_output_gate")? == Some(false) {
        return Err(KylinError::operator_unsupported(format!(
            "config.json sets attn_output_gate to false; {family}'s attention always gates its output (transformers' attention class)"
        )));
    }
    let d = &mut c.decoder;
    d.norm = NormKind::RmsUnitOffset;
    d.qk_norm = QkNorm::PerHead;
    d.attention_output_gate = true;
    super::default_partial_rotary(hf, c, 0.25);
    mrope_sections(hf, c)?;
    layer_types(hf, c, family)?;
    linear_sizes(hf, c)
}

/// `mrope_section` (the multimodal RoPE's split of the rotary frequencies between time,
/// height and width; transformers' default `[11, 11, 10]`), interleaved as Qwen3.5's rotary
/// module always lays it out. Set for the vision-language classes, whose image tokens take a
/// position per axis; text tokens take their position on every section, which is the ordinary
/// RoPE, so the text classes leave it unset.
fn mrope_sections(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let sections = match hf.rope_parameters.as_ref().and_then(|p| p.get("mrope_section")) {
        None | Some(serde_json::Value::Null) => [11, 11, 10],
        Some(serde_json::Value::Array(items))
            if items.len() == 3 && items.iter().all(|v| v.as_u64().is_some_and(|n| n <= 1 << 16)) =>
        {
            [0, 1, 2].map(|i| items[i].as_u64().map_or(0, |n| n as usize))
        }
        Some(other) => {
            return Err(crate::config::bad(
                "rope_parameters.mrope_section",
                "a list of 3 non-negative integers",
                other,
            ));
        }
    };
    if c.multimodal.is_some() {
        c.rope.multimodal = Some(crate::config::MultimodalRope { sections, interleaved: true });
    }
    Ok(())
}

/// Which layers are linear attention: `layer_types` (`linear_attention` / `full_attention`),
/// else every `full_attention_interval`-th layer (default 4) is full attention.
fn layer_types(hf: &HfConfig, c: &mut ModelConfig, family: &str) -> Result<()> {
    let n = c.num_layers;
    let kinds: Vec<MixerKind> = match &hf.layer_types {
        Some(types) => super::mixers_from_layer_types(types, n, family, "linear_attention", MixerKind::GatedDeltaNet)?,
        None => {
            let interval = match raw_u64(hf, "full_attention_interval")? {
                Some(0) => {
                    return Err(KylinError::config_invalid(
                        "config.json field 'full_attention_interval' is 0; it must be positive",
                    ));
                }
                Some(v) => v as usize,
                None => {
                    c.defaulted.push("layer_types".into());
                    4
                }
            };
            (0..n)
                .map(|i| if (i + 1) % interval == 0 { MixerKind::Attention } else { MixerKind::GatedDeltaNet })
                .collect()
        }
    };
    for (layer, kind) in c.decoder.layers.iter_mut().zip(kinds) {
        layer.mixer = kind;
    }
    Ok(())
}

/// A positive size no larger than `max`, or `CONFIG_INVALID` / `OPERATOR_UNSUPPORTED` naming
/// the field.
pub(crate) fn size_field(hf: &HfConfig, key: &str, default: usize, max: usize, c: &mut ModelConfig) -> Result<usize> {
    let v = match raw_u64(hf, key)? {
        Some(v) => v,
        None => {
            c.defaulted.push(key.to_string());
            default as u64
        }
    };
    if v == 0 {
        return Err(KylinError::config_invalid(format!("config.json field '{key}' is 0; it must be positive")));
    }
    if v > max as u64 {
        return Err(KylinError::operator_unsupported(format!(
            "config.json field '{key}' is {v}; Kylin's linear-attention kernels take at most {max}"
        )));
    }
    Ok(v as usize)
}

/// The Gated DeltaNet sizes (`linear_*`), with transformers' defaults.
fn linear_sizes(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let key_heads = size_field(hf, "linear_num_key_heads", 16, 1 << 12, c)?;
    let value_heads = size_field(hf, "linear_num_value_heads", 32, 1 << 12, c)?;
    let key_head_dim = size_field(hf, "linear_key_head_dim", 128, MAX_LINEAR_HEAD_DIM, c)?;
    let value_head_dim = size_field(hf, "linear_value_head_dim", 128, MAX_LINEAR_HEAD_DIM, c)?;
    let conv_kernel = size_field(hf, "linear_conv_kernel_dim", 4, MAX_CONV_KERNEL, c)?;
    if !value_heads.is_multiple_of(key_heads) {
        return Err(KylinError::config_invalid(format!(
            "config.json: linear_num_value_heads={value_heads} is not a multiple of linear_num_key_heads={key_heads}"
        )));
    }
    if c.decoder.layers.iter().any(|l| l.mixer == MixerKind::GatedDeltaNet) {
        c.decoder.linear_attention = Some(LinearAttention {
            key_heads,
            value_heads,
            key_head_dim,
            value_head_dim,
            conv_kernel,
            grouped_projections: false,
        });
    }
    Ok(())
}
