//! Phi-3 / Phi-4-mini (`Phi3ForCausalLM`): Llama's block with q, k and v fused into one
//! `qkv_proj` and gate and up into one `gate_up_proj` (split into views when bound), LongRoPE,
//! partial rotary (Phi-4-mini rotates 3/4 of each head) and an optional sliding window.

use super::{Defaults, Family, LLAMA_DEFAULTS};
use crate::arch::{EMBED_HEAD, FUSED_ATTENTION, FUSED_MLP, PRE_NORMS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Phi3ForCausalLM",
    model_type: "phi3",
    multimodal: None,
    about: "fused qkv_proj and gate_up_proj, longrope scaling, partial rotary",
    // Phi3Config(max_position_embeddings=4096, rms_norm_eps=1e-5).
    defaults: Defaults { max_position_embeddings: 4096, rms_norm_eps: 1e-5, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, FUSED_ATTENTION, FUSED_MLP],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    // Phi3Attention: every layer slides when `sliding_window` is set (Phi-3-mini-4k: 2047).
    let window = super::sliding_window(hf)?;
    super::every_layer_slides(c, window);
    Ok(())
}
