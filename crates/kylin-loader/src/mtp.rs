//! The multi-token-prediction (MTP) head that Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints
//! ship beside their decoder (`mtp.*`), bound for speculative decoding.
//!
//! The head proposes the token after next. For position `i`, with `h_i` the target's hidden
//! state after its final norm and `t` the token that follows position `i`:
//!
//! ```text
//! x   = fc(cat(pre_fc_norm_embedding(embed(t)), pre_fc_norm_hidden(h_i)))   (hidden) <- (2 · hidden)
//! y   = norm(layer(x))            one full-attention decoder layer of the family, at position i,
//!                                 attending over the head's own keys and values
//! out = lm_head(y)                the target's head; the embedding is the target's too
//! ```
//!
//! Further proposals feed the head its own `y` in place of `h` (as vLLM and SGLang run it).
//!
//! The layer's tensors are the family's own decoder-layer tensors under `mtp.layers.0.`, so the
//! head is bound with the family's tensor table through a [`TensorMap`] that renames
//! `model.layers.{layer}.` to `mtp.layers.{layer}.` and `model.norm` to `mtp.norm`: shapes,
//! dtypes, experts in either layout and published quantized formats are checked exactly as the
//! decoder's are, and every error names the checkpoint's tensor.

use crate::arch::{self, TensorMap};
use crate::config::ModelConfig;
use crate::error::{KylinError, Result};
use crate::family::{FfnKind, MixerKind};
use crate::safetensors_file::TensorIndex;
use crate::tensor::WeightTensor;
use crate::weights::ModelWeights;

/// The name that marks a checkpoint with an MTP head.
pub const MTP_FC: &str = "mtp.fc.weight";

/// A bound MTP head: a one-layer decoder (`config`, `weights`: the shared embedding and head,
/// `mtp.norm` as its final norm, the `mtp.layers.0.*` layer) and the projection in front of it.
#[derive(Debug)]
pub struct MtpHead {
    /// The target's configuration cut to the head's one full-attention layer.
    pub config: ModelConfig,
    pub weights: ModelWeights,
    /// `[hidden, 2 · hidden]`: the normed embedding's columns first, then the hidden state's.
    pub fc: WeightTensor,
    /// `[hidden]` each.
    pub pre_fc_norm_embedding: WeightTensor,
    pub pre_fc_norm_hidden: WeightTensor,
    /// The checkpoint's tensors the head reads.
    pub tensors: Vec<String>,
}

/// Binds the MTP head of a checkpoint whose decoder is `config` (bound with `main`, the
/// decoder's tensor map). `Ok(None)` when the checkpoint has no `mtp.fc.weight`.
///
/// `OPERATOR_UNSUPPORTED` for a family without MTP heads or a head of several layers;
/// `TENSOR_MISSING`, `TENSOR_SHAPE_MISMATCH` or `TENSOR_DTYPE_UNSUPPORTED` naming the
/// checkpoint's `mtp.*` tensor otherwise.
pub(crate) fn bind(config: &ModelConfig, index: &TensorIndex, main: &TensorMap) -> Result<Option<MtpHead>> {
    if index.raw(MTP_FC).is_none() {
        return Ok(None);
    }
    let family = config.architecture.hf_name();
    // The head's layer is a full-attention layer of the family: the decoder's own kind.
    let Some(mut layer) = config.decoder.layers.iter().find(|l| l.mixer == MixerKind::Attention).copied() else {
        return Err(KylinError::operator_unsupported(format!(
            "{family} has no full-attention layer to take the MTP layer's shape from"
        )));
    };
    if !config.decoder.layers.iter().any(|l| l.mixer.is_recurrent()) {
        return Err(KylinError::operator_unsupported(format!(
            "the checkpoint has {MTP_FC}, but Kylin runs MTP heads of Qwen3.5, Qwen3.5-MoE and Qwen3-Next only, not of {family}"
        )));
    }
    let layers: std::collections::BTreeSet<&str> =
        index.names().filter_map(|n| n.strip_prefix("mtp.layers.")?.split('.').next()).collect();
    match layers.len() {
        1 if layers.contains("0") => {}
        0 => {
            return Err(KylinError::tensor_missing(format!(
                "the checkpoint has {MTP_FC} but no mtp.layers.0.* tensors (the head's decoder layer)"
            )));
        }
        n => {
            return Err(KylinError::operator_unsupported(format!(
                "the MTP head has {n} layers (mtp.layers.{}); Kylin runs heads of one layer, as Qwen3.5 and \
                 Qwen3-Next publish them",
                layers.into_iter().collect::<Vec<_>>().join(", mtp.layers.")
            )));
        }
    }
    // A model with experts has them on its head's layer too, whichever decoder layers
    // Qwen3-Next's `decoder_sparse_step` and `mlp_only_layers` keep dense.
    if config.decoder.moe.is_some() && layer.ffn == FfnKind::Dense {
        layer.ffn = FfnKind::Moe;
    }
    let mut head_config = config.clone();
    head_config.num_layers = 1;
    head_config.decoder.layers = vec![layer];
    head_config.decoder.linear_attention = None;
    // The table's names, the decoder's layers and final norm moved under `mtp.`; the embedding
    // and the head as the decoder binds them.
    let renames = arch::table_names(config.architecture)
        .into_iter()
        .map(|name| {
            let to = if let Some(rest) = name.strip_prefix("model.layers.") {
                format!("mtp.layers.{rest}")
            } else if name == "model.norm.weight" {
                "mtp.norm.weight".to_string()
            } else {
                main.name_for(name)
            };
            (name.to_string(), to)
        })
        .collect();
    let bound = arch::bind(&head_config, index, &TensorMap { renames })?;
    let hidden = config.hidden_size;
    let vector = |name: &str, shape: Vec<usize>| -> Result<WeightTensor> {
        let raw = index.raw(name).ok_or_else(|| {
            KylinError::tensor_missing(format!("the MTP head's tensor '{name}' is missing from the checkpoint"))
        })?;
        if raw.shape != shape {
            return Err(KylinError::tensor_shape_mismatch(format!(
                "tensor '{name}' has shape {:?}; expected {shape:?} (hidden_size {hidden})",
                raw.shape
            )));
        }
        match (raw.dtype, index.view(name)) {
            (Some(dt), Some(view)) if dt.is_float() => Ok(view),
            _ => Err(KylinError::tensor_dtype_unsupported(format!(
                "tensor '{name}' is stored as {}; the MTP head computes on BF16, F16 or F32 only",
                raw.dtype_name
            ))),
        }
    };
    let fc = vector(MTP_FC, vec![hidden, 2 * hidden])?;
    let pre_fc_norm_embedding = vector("mtp.pre_fc_norm_embedding.weight", vec![hidden])?;
    let pre_fc_norm_hidden = vector("mtp.pre_fc_norm_hidden.weight", vec![hidden])?;
    let mut tensors: Vec<String> = bound
        .weights
        .tensors()
        .into_iter()
        .map(|t| t.name.clone())
        .filter(|n| n.starts_with("mtp."))
        .chain([fc.name.clone(), pre_fc_norm_embedding.name.clone(), pre_fc_norm_hidden.name.clone()])
        .collect();
    tensors.sort();
    tensors.dedup();
    Ok(Some(MtpHead {
        config: head_config,
        weights: bound.weights,
        fc,
        pre_fc_norm_embedding,
        pre_fc_norm_hidden,
        tensors,
    }))
}
