//! Gemma 2 (`Gemma2ForCausalLM`): `(1 + w)` RMSNorms before and after attention and the MLP,
//! GeGLU, the embedding scaled by `√hidden_size`, sliding and global layers alternating,
//! queries scaled by `query_pre_attn_scalar^-0.5`, and tanh soft-capping of the attention
//! scores (50) and of the final logits (30).
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`; q, k, v `(n, heads · head_dim)`; RoPE; attention over the
//!    window (even layers) or the whole sequence (odd layers), scores soft-capped;
//!    `o_proj` → `(n, hidden)`; `x += post_attention_layernorm(h)`.
//! 2. `h = pre_feedforward_layernorm(x)`; `down(gelu_tanh(gate(h)) · up(h))`;
//!    `x += post_feedforward_layernorm(h)`.

use super::{Defaults, Family, LLAMA_DEFAULTS};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, O_BIAS, QKV_BIAS, SANDWICH_NORMS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Gemma2ForCausalLM",
    model_type: "gemma2",
    multimodal: None,
    about: "sliding/global alternation, attention and final soft-capping, (1+w) sandwich norms, GeGLU",
    // Gemma2Config(max_position_embeddings=8192, head_dim=256, tie_word_embeddings=True).
    defaults: Defaults {
        max_position_embeddings: 8192,
        head_dim: Some(256),
        tie_word_embeddings: true,
        ..LLAMA_DEFAULTS
    },
    resolve,
    tensors: &[EMBED_HEAD, SANDWICH_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    super::gemma_block(hf, c)?;
    c.decoder.attention_softcap = super::nullable_positive(hf, "attn_logit_softcapping", Some(50.0), c)?;
    c.decoder.final_softcap = super::nullable_positive(hf, "final_logit_softcapping", Some(30.0), c)?;
    // Gemma2Config: layer i slides when (i + 1) % 2 != 0.
    super::gemma_layers(hf, c, 2)
}
