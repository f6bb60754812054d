//! Mistral (`MistralForCausalLM`): Llama's block without biases, with a sliding window on
//! every layer when `sliding_window` is set (its default is 4096).

use super::{Defaults, Family, LLAMA_DEFAULTS};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, PRE_NORMS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "MistralForCausalLM",
    model_type: "mistral",
    multimodal: None,
    about: "sliding-window attention on every layer",
    defaults: Defaults { max_position_embeddings: 4096 * 32, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    // MistralConfig(sliding_window=4096): absent means the default, `null` means none.
    let window = if hf.sliding_window_present { super::sliding_window(hf)? } else { Some(4096) };
    super::every_layer_slides(c, window);
    Ok(())
}
