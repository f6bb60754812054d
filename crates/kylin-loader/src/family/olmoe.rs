//! OLMoE (`OlmoeForCausalLM`): Llama's pre-norms, q/k RMSNorm over the whole projection (as
//! OLMo 2), and routed experts on every layer (`norm_topk_prob` off by default) of width
//! `intermediate_size`.

use super::{Defaults, Family, FfnKind, LLAMA_DEFAULTS, MoeDefaults, QkNorm};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP_EXPERTS, MLP_ROUTER, O_BIAS, PRE_NORMS, PROJECTION_QK_NORM, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig, raw_f64};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "OlmoeForCausalLM",
    model_type: "olmoe",
    multimodal: None,
    about: "q/k RMSNorm over the projection, routed experts on every layer",
    // OlmoeConfig(max_position_embeddings=4096, rms_norm_eps=1e-5).
    defaults: Defaults { max_position_embeddings: 4096, rms_norm_eps: 1e-5, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, QKV_BIAS, O_BIAS, PROJECTION_QK_NORM, MLP_ROUTER, MLP_EXPERTS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.attention_bias_or_default(c);
    if let Some(clip) = raw_f64(hf, "clip_qkv")? {
        return Err(KylinError::operator_unsupported(format!(
            "config.json sets clip_qkv to {clip}; Kylin's OLMoE block does not clamp q, k and v (published OLMoE checkpoints leave it null)"
        )));
    }
    c.decoder.qk_norm = QkNorm::Projection;
    let defaults = MoeDefaults {
        num_experts: 64,
        top_k: 8,
        width_key: "intermediate_size",
        width: c.intermediate_size,
        normalize: Some(false),
    };
    c.decoder.moe = Some(super::moe_fields(hf, c, &defaults)?);
    for layer in &mut c.decoder.layers {
        layer.ffn = FfnKind::Moe;
    }
    Ok(())
}
