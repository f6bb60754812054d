//! SmolLM3 (`SmolLM3ForCausalLM`): Llama's block with no RoPE on every `no_rope_layer_interval`-th
//! layer (`no_rope_layers[i] == 0`).

use super::{Defaults, Family, LLAMA_DEFAULTS, LayerRope};
use crate::arch::{ATTENTION, EMBED_HEAD, MLP, MLP_BIAS, O_BIAS, PRE_NORMS, QKV_BIAS};
use crate::config::{HfConfig, ModelConfig, raw_u64, raw_u64_list};
use crate::error::{KylinError, Result};

pub const FAMILY: Family = Family {
    hf_name: "SmolLM3ForCausalLM",
    model_type: "smollm3",
    multimodal: None,
    about: "no RoPE on every n-th layer (NoPE)",
    defaults: Defaults {
        max_position_embeddings: 32768,
        rope_theta: 2_000_000.0,
        tie_word_embeddings: true,
        ..LLAMA_DEFAULTS
    },
    resolve,
    tensors: &[EMBED_HEAD, PRE_NORMS, ATTENTION, MLP, QKV_BIAS, O_BIAS, MLP_BIAS],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    hf.silu_only(c)?;
    hf.llama_biases_or_default(c);
    let n = c.num_layers;
    // transformers: `no_rope_layers[i]` is 1 where layer i uses RoPE; by default every
    // `no_rope_layer_interval`-th layer (4) has none.
    let uses_rope: Vec<bool> = match raw_u64_list(hf, "no_rope_layers")? {
        Some(list) if list.len() == n => list.iter().map(|&v| v != 0).collect(),
        Some(list) => {
            return Err(KylinError::config_invalid(format!(
                "config.json no_rope_layers has {} entries; num_hidden_layers is {n}",
                list.len()
            )));
        }
        None => {
            let interval = raw_u64(hf, "no_rope_layer_interval")?.unwrap_or(4).max(1) as usize;
            (0..n).map(|i| (i + 1) % interval != 0).collect()
        }
    };
    let window = if hf.use_sliding_window == Some(true) { super::sliding_window(hf)? } else { None };
    let windows = match (&hf.layer_types, window) {
        (_, None) => vec![None; n],
        (Some(types), w) => super::windows_from_layer_types(types, n, w)?,
        // transformers: with a window, the NoPE layers slide.
        (None, w) => uses_rope.iter().map(|&r| if r { None } else { w }).collect(),
    };
    for ((layer, rope), w) in c.decoder.layers.iter_mut().zip(uses_rope).zip(windows) {
        layer.rope = if rope { LayerRope::Global } else { LayerRope::None };
        layer.window = w;
    }
    Ok(())
}
