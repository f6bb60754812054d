//! LFM2 (`Lfm2ForCausalLM`, Liquid AI): short-convolution layers beside attention layers
//! (`layer_types`, else `full_attn_idxs`), every layer with a SwiGLU MLP (`feed_forward`:
//! `w1` gate, `w3` up, `w2` down). Every norm is a plain RMSNorm with `norm_eps`; the final
//! norm is called `embedding_norm` but applies after the layers.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = operator_norm(x)`, then the mixer:
//!    - short convolution: `B, C, x' = in_proj(h)` `(n, 3 · hidden)`; `y = C · conv(B · x')`
//!      with the depthwise causal `conv` of `conv_L_cache` taps (state: the last
//!      `conv_L_cache - 1` rows of `B · x'`, no activation); `out_proj(y)`;
//!    - attention: q, k, v; per-head `q_layernorm`/`k_layernorm`; RoPE; attention; `out_proj`;
//!
//!    `x += mixer(h)`.
//! 2. `x += feed_forward(ffn_norm(x))`.
//!
//! The MLP's width: `intermediate_size` (or `block_ff_dim`), and with `block_auto_adjust_ff_dim`
//! (the default) `int(2 · width / 3)`, times `block_ffn_dim_multiplier`, rounded up to a
//! multiple of `block_multiple_of`, as transformers' `Lfm2MLP` computes it.

use super::{Defaults, Family, LLAMA_DEFAULTS, MixerKind, QkNorm, ShortConv};
use crate::arch::{LFM2_ATTENTION, LFM2_EMBED_HEAD, LFM2_MLP, LFM2_NORMS, SHORT_CONV};
use crate::config::{HfConfig, ModelConfig, raw_bool, raw_f64, raw_u64, raw_u64_list};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "Lfm2ForCausalLM",
    model_type: "lfm2",
    multimodal: None,
    about: "short-convolution layers beside attention layers, per-head q/k norms",
    defaults: LFM2_DEFAULTS,
    resolve,
    tensors: &[LFM2_EMBED_HEAD, LFM2_NORMS, LFM2_ATTENTION, SHORT_CONV, LFM2_MLP],
};

/// `Lfm2Config`'s (and `Lfm2MoeConfig`'s) defaults: max_position_embeddings=128000, rope theta
/// 1e6, tie_word_embeddings=True, norm_eps 1e-5.
pub(super) const LFM2_DEFAULTS: Defaults = Defaults {
    max_position_embeddings: 128_000,
    rope_theta: 1_000_000.0,
    tie_word_embeddings: true,
    rms_norm_eps: 1e-5,
    ..LLAMA_DEFAULTS
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    mixers(hf, c)?;
    mlp_width(hf, c)
}

/// Everything but the MLP's width, which LFM2-MoE shares: the per-head q/k norms, `norm_eps`,
/// `tie_embedding`, the layers' mixers and the short convolution's sizes.
pub(super) fn mixers(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    c.decoder.qk_norm = QkNorm::PerHead;
    // Every norm uses `norm_eps` (default 1e-5); `rms_norm_eps`, if written, is not read by
    // transformers' LFM2.
    c.rms_norm_eps = match raw_f64(hf, "norm_eps")? {
        Some(e) if e > 0.0 && e < 1.0 => e,
        Some(e) => {
            return Err(KylinError::config_invalid(format!(
                "config.json field 'norm_eps' is {e}; it must be in (0, 1)"
            )));
        }
        None => {
            c.defaulted.push("norm_eps".into());
            1e-5
        }
    };
    // `tie_embedding` is LFM2's older name, and takes precedence as in transformers.
    if let Some(tie) = raw_bool(hf, "tie_embedding")? {
        c.tie_word_embeddings = tie;
    }
    layer_types(hf, c)?;
    let kernel = super::qwen3_5::size_field(hf, "conv_L_cache", 3, super::qwen3_5::MAX_CONV_KERNEL, c)?;
    let bias = raw_bool(hf, "conv_bias")?.unwrap_or_else(|| {
        c.defaulted.push("conv_bias".into());
        false
    });
    if c.decoder.layers.iter().any(|l| l.mixer == MixerKind::ShortConv) {
        c.decoder.short_conv = Some(ShortConv { kernel, bias });
    }
    Ok(())
}

/// `layer_types` (`conv` / `full_attention`), else `full_attn_idxs` (default: every layer is
/// attention, as transformers defaults it).
fn layer_types(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let n = c.num_layers;
    let kinds: Vec<MixerKind> = match &hf.layer_types {
        Some(types) => super::mixers_from_layer_types(types, n, "LFM2", "conv", MixerKind::ShortConv)?,
        None => {
            let full = match raw_u64_list(hf, "full_attn_idxs")? {
                Some(idxs) => {
                    if let Some(&bad) = idxs.iter().find(|&&i| i as usize >= n) {
                        return Err(KylinError::config_invalid(format!(
                            "config.json full_attn_idxs names layer {bad}; num_hidden_layers is {n}"
                        )));
                    }
                    idxs.into_iter().map(|i| i as usize).collect::<Vec<_>>()
                }
                None => {
                    c.defaulted.push("layer_types".into());
                    (0..n).collect()
                }
            };
            (0..n).map(|i| if full.contains(&i) { MixerKind::Attention } else { MixerKind::ShortConv }).collect()
        }
    };
    for (layer, kind) in c.decoder.layers.iter_mut().zip(kinds) {
        layer.mixer = kind;
    }
    Ok(())
}

/// The MLP width transformers' `Lfm2MLP` builds (see the module documentation).
fn mlp_width(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let auto = raw_bool(hf, "block_auto_adjust_ff_dim")?.unwrap_or_else(|| {
        c.defaulted.push("block_auto_adjust_ff_dim".into());
        true
    });
    if !auto {
        return Ok(());
    }
    let mut width = 2 * c.intermediate_size / 3;
    let multiplier = raw_f64(hf, "block_ffn_dim_multiplier")?;
    if !hf.raw.contains_key("block_ffn_dim_multiplier") {
        c.defaulted.push("block_ffn_dim_multiplier".into());
    }
    let multiplier = if hf.raw.contains_key("block_ffn_dim_multiplier") { multiplier } else { Some(1.0) };
    if let Some(m) = multiplier {
        if !(m > 0.0 && m <= 64.0) {
            return Err(KylinError::config_invalid(format!(
                "config.json field 'block_ffn_dim_multiplier' is {m}; it must be in (0, 64]"
            )));
        }
        let multiple = match raw_u64(hf, "block_multiple_of")? {
            Some(0) => {
                return Err(KylinError::config_invalid(
                    "config.json field 'block_multiple_of' is 0; it must be positive",
                ));
            }
            Some(v) if v <= 1 << 20 => v as usize,
            Some(v) => {
                return Err(KylinError::config_invalid(format!(
                    "config.json field 'block_multiple_of' is {v}, which is implausibly large"
                )));
            }
            None => {
                c.defaulted.push("block_multiple_of".into());
                256
            }
        };
        width = (m * width as f64) as usize;
        width = width.div_ceil(multiple) * multiple;
    }
    if width == 0 {
        return Err(KylinError::config_invalid(format!(
            "config.json: the MLP width adjusted from intermediate_size={} is 0",
            c.intermediate_size
        )));
    }
    c.intermediate_size = width;
    for layer in &mut c.decoder.layers {
        layer.intermediate = width;
    }
    Ok(())
}
