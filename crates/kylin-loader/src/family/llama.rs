//! Llama (`LlamaForCausalLM`): pre-norm RMSNorm, grouped-query attention with rotate-half
//! RoPE, SwiGLU. The plain decoder every other family starts from.

use super::{Family, LLAMA_DEFAULTS};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, MLP_BIAS, O_BIAS, PRE_NORMS, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "LlamaForCausalLM",
    model_type: "llama",
    multimodal: None,
    about: "the plain decoder: pre-norm RMSNorm, GQA, RoPE (llama3 scaling), SwiGLU",
    defaults: LLAMA_DEFAULTS,
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS, MLP_BIAS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.llama_biases_or_default(c);
    Ok(())
}
