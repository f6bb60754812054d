//! Mixtral (`MixtralForCausalLM`): Mistral's block (an optional sliding window on every layer)
//! with `block_sparse_moe` experts on every layer: a softmax router, the top two (by default),
//! always renormalised, SwiGLU experts `w1` (gate), `w3` (up), `w2` (down) of width
//! `intermediate_size`.

use super::{Defaults, Family, FfnKind, LLAMA_DEFAULTS, MoeDefaults};
use crate::arch::{ATTENTION, BLOCK_SPARSE_MOE, EMBED_HEAD, PRE_NORMS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "MixtralForCausalLM",
    model_type: "mixtral",
    multimodal: None,
    about: "block_sparse_moe experts (w1/w3/w2) on every layer, optional sliding window",
    // MixtralConfig(max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6).
    defaults: Defaults { max_position_embeddings: 4096 * 32, rms_norm_eps: 1e-5, rope_theta: 1e6, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, BLOCK_SPARSE_MOE],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    // MixtralConfig(sliding_window=None).
    let window = if hf.sliding_window_present { super::sliding_window(hf)? } else { None };
    super::every_layer_slides(c, window);
    let defaults = MoeDefaults {
        num_experts: 8,
        top_k: 2,
        width_key: "intermediate_size",
        width: c.intermediate_size,
        normalize: None,
    };
    c.decoder.moe = Some(super::moe_fields(hf, c, &defaults)?);
    for layer in &mut c.decoder.layers {
        layer.ffn = FfnKind::Moe;
    }
    Ok(())
}
