//! Gemma 3 (`Gemma3ForCausalLM`, the text model; `model_type` `gemma3_text`): Gemma 2's
//! sandwich block with per-head `(1 + w)` q/k norms, five sliding layers to one global, and
//! separate RoPE bases for the two (local 10 000, global 1 000 000, the global one possibly
//! scaled). Soft-capping is off unless configured.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`; q, k, v; `q_norm`/`k_norm` per head; RoPE with the local
//!    table (sliding layers) or the global one; attention over the window or everything;
//!    `o_proj`; `x += post_attention_layernorm(h)`.
//! 2. `h = pre_feedforward_layernorm(x)`; `down(gelu_tanh(gate(h)) · up(h))`;
//!    `x += post_feedforward_layernorm(h)`.

use serde_json::{Map, Value};

use super::{Defaults, Family, LLAMA_DEFAULTS, LayerRope, QkNorm};
use crate::arch::{ATTENTION, EMBED_HEAD, HEAD_QK_NORM, MLP, O_BIAS, QKV_BIAS, SANDWICH_NORMS};
use crate::config::{HfConfig, ModelConfig, raw_bool, raw_f64, raw_u64};
use crate::error::{KylinError, Result};

/// transformers' `Gemma3TextConfig.default_theta`.
const GLOBAL_THETA: f64 = 1_000_000.0;
const LOCAL_THETA: f64 = 10_000.0;

pub const FAMILY: Family = Family {
    hf_name: "Gemma3ForCausalLM",
    model_type: "gemma3_text",
    multimodal: Some("Gemma3ForConditionalGeneration"),
    about: "5:1 sliding/global, per-head q/k norms, local and global RoPE bases",
    // Gemma3TextConfig(max_position_embeddings=131072, head_dim=256, tie_word_embeddings=True).
    defaults: Defaults {
        max_position_embeddings: 131_072,
        head_dim: Some(256),
        rope_theta: GLOBAL_THETA,
        tie_word_embeddings: true,
        ..LLAMA_DEFAULTS
    },
    resolve,
    tensors: &[EMBED_HEAD, SANDWICH_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS, HEAD_QK_NORM],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    if raw_bool(hf, "use_bidirectional_attention")? == Some(true) {
        return Err(KylinError::operator_unsupported(
            "config.json sets use_bidirectional_attention (an embedding model such as EmbeddingGemma); Kylin runs Gemma 3 as a causal language model",
        ));
    }
    super::gemma_block(hf, c)?;
    c.decoder.qk_norm = QkNorm::PerHead;
    c.decoder.attention_softcap = super::nullable_positive(hf, "attn_logit_softcapping", None, c)?;
    c.decoder.final_softcap = super::nullable_positive(hf, "final_logit_softcapping", None, c)?;
    // The pattern: `sliding_window_pattern` in published configs (6), `_sliding_window_pattern`
    // in transformers 5's.
    let pattern = match raw_u64(hf, "sliding_window_pattern")? {
        Some(p) => p,
        None => raw_u64(hf, "_sliding_window_pattern")?.unwrap_or(6),
    } as usize;
    super::gemma_layers(hf, c, pattern)?;

    // RoPE per layer type. transformers 5 writes `rope_parameters: {full_attention: {...},
    // sliding_attention: {...}}`; published configs write `rope_theta` (global),
    // `rope_local_base_freq` and `rope_scaling` (which applies to the global table only).
    let per_type = |k: &str| -> Option<&Map<String, Value>> {
        match hf.rope_parameters.as_ref()?.get(k) {
            Some(Value::Object(m)) => Some(m),
            _ => None,
        }
    };
    let empty = Map::new();
    let max = c.max_position_embeddings;
    let (global, local) = if per_type("full_attention").is_some() || per_type("sliding_attention").is_some() {
        let global = hf.resolve_rope_params(
            per_type("full_attention").unwrap_or(&empty),
            "rope_parameters.full_attention",
            hf.rope_theta,
            GLOBAL_THETA,
            max,
            &mut c.defaulted,
        )?;
        let local_theta = raw_f64(hf, "rope_local_base_freq")?;
        let local = hf.resolve_rope_params(
            per_type("sliding_attention").unwrap_or(&empty),
            "rope_parameters.sliding_attention",
            local_theta,
            LOCAL_THETA,
            max,
            &mut c.defaulted,
        )?;
        (global, local)
    } else {
        let local_theta = raw_f64(hf, "rope_local_base_freq")?.unwrap_or_else(|| {
            c.defaulted.push("rope_local_base_freq".into());
            LOCAL_THETA
        });
        let local = hf.resolve_rope_params(
            &empty,
            "rope_local_base_freq",
            Some(local_theta),
            LOCAL_THETA,
            max,
            &mut c.defaulted,
        )?;
        (c.rope.clone(), local)
    };
    c.rope = global;
    c.decoder.local_rope = Some(local);
    for layer in &mut c.decoder.layers {
        layer.rope = if layer.window.is_some() { LayerRope::Local } else { LayerRope::Global };
    }
    Ok(())
}
