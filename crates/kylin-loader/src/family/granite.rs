//! Granite 3 (`GraniteForCausalLM`): Llama's block with four scalar multipliers: the
//! embedding, each residual branch, the attention scores (instead of `head_dim^-0.5`), and
//! the logits (divided).

use super::{Family, LLAMA_DEFAULTS};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, MLP_BIAS, O_BIAS, PRE_NORMS, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig, raw_f64};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "GraniteForCausalLM",
    model_type: "granite",
    multimodal: None,
    about: "embedding, residual, attention and logit multipliers",
    defaults: LLAMA_DEFAULTS,
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS, MLP_BIAS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.llama_biases_or_default(c);
    // GraniteConfig: every multiplier defaults to 1.0 (the attention scale too).
    let mut multiplier = |key: &str| -> Result<f64> {
        match raw_f64(hf, key)? {
            Some(v) if v != 0.0 => Ok(v),
            Some(v) => {
                Err(KylinError::config_invalid(format!("config.json field '{key}' is {v}; it must be non-zero")))
            }
            None => {
                c.defaulted.push(key.to_string());
                Ok(1.0)
            }
        }
    };
    let embedding = multiplier("embedding_multiplier")?;
    let residual = multiplier("residual_multiplier")?;
    let attention = multiplier("attention_multiplier")?;
    let logits = multiplier("logits_scaling")?;
    c.decoder.embedding_scale = embedding;
    c.decoder.residual_scale = residual;
    c.decoder.attention_scale = attention;
    c.decoder.logits_divisor = logits;
    Ok(())
}
