//! Qwen3 (`Qwen3ForCausalLM`): Llama's block with a per-head RMSNorm on queries and keys
//! before RoPE, and optional sliding layers past `max_window_layers`.

use super::{Defaults, Family, LLAMA_DEFAULTS, QkNorm};
use crate::arch::{ATTENTION, EMBED_HEAD, HEAD_QK_NORM, MLP, O_BIAS, PRE_NORMS, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Qwen3ForCausalLM",
    model_type: "qwen3",
    multimodal: None,
    about: "per-head q/k RMSNorm, GQA, head_dim independent of hidden_size",
    // Qwen3Config(head_dim=128, max_position_embeddings=32768).
    defaults: Defaults { max_position_embeddings: 32768, head_dim: Some(128), ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS, HEAD_QK_NORM],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.attention_bias_or_default(c);
    c.decoder.qk_norm = QkNorm::PerHead;
    super::qwen2::sliding_layers(hf, c)
}
