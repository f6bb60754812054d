//! OLMo 2 (`Olmo2ForCausalLM`): norms after each sub-block only (no pre-norms), and RMSNorm
//! on the whole query and key projections (not per head) before RoPE.

use super::{Defaults, Family, LLAMA_DEFAULTS, NormPlacement, QkNorm};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, O_BIAS, POST_NORMS, PROJECTION_QK_NORM, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Olmo2ForCausalLM",
    model_type: "olmo2",
    multimodal: None,
    about: "post-norms only, q/k RMSNorm over the whole projection",
    // Olmo2Config(rms_norm_eps=1e-5).
    defaults: Defaults { rms_norm_eps: 1e-5, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, POST_NORMS, ATTENTION, MLP, PROJECTION_QK_NORM, QKV_BIAS, O_BIAS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.attention_bias_or_default(c);
    c.decoder.attention_norms = NormPlacement::Post;
    c.decoder.mlp_norms = NormPlacement::Post;
    c.decoder.qk_norm = QkNorm::Projection;
    Ok(())
}
