//! Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama's block with biases on q, k and v, and
//! optional sliding layers past `max_window_layers`.

use super::{Defaults, Family, LLAMA_DEFAULTS};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, PRE_NORMS, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig};
use crate::error::Result;

pub const FAMILY: Family = Family {
    hf_name: "Qwen2ForCausalLM",
    model_type: "qwen2",
    multimodal: None,
    about: "q/k/v biases",
    defaults: Defaults { max_position_embeddings: 32768, ..LLAMA_DEFAULTS },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    // Qwen2's q/k/v projections always carry a bias; o_proj and the MLP never do.
    c.qkv_bias = true;
    sliding_layers(hf, c)
}

/// Qwen's sliding layers: with `use_sliding_window`, `layer_types` when written, else layer
/// `i` slides when `i >= max_window_layers` (transformers' `Qwen2Config`).
pub(super) fn sliding_layers(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let window = if hf.use_sliding_window == Some(true) { super::sliding_window(hf)? } else { None };
    let windows = match (&hf.layer_types, window) {
        (_, None) => vec![None; c.num_layers],
        (Some(types), w) => super::windows_from_layer_types(types, c.num_layers, w)?,
        (None, w) => {
            let first = hf.max_window_layers.unwrap_or(28) as usize;
            (0..c.num_layers).map(|i| if i >= first { w } else { None }).collect()
        }
    };
    for (layer, w) in c.decoder.layers.iter_mut().zip(windows) {
        layer.window = w;
    }
    Ok(())
}
