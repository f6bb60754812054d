//! The multi-token-prediction (MTP) head that Qwen3.5, Qwen3.5-MoE and Qwen3-Next checkpoints
//! ship beside their decoder (`mtp.*`), and the NextN layer of GLM-4.5's (DeepSeek-V3's layout,
//! `num_nextn_predict_layers`), bound for speculative decoding.
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
//! Two layouts name the same parts ([`Layout`]):
//!
//! | part | Qwen (`mtp.*`) | NextN (`model.layers.{L}.*`, `L = num_hidden_layers`) |
//! |---|---|---|
//! | `fc` | `mtp.fc` | `eh_proj` |
//! | `pre_fc_norm_embedding` | `mtp.pre_fc_norm_embedding` | `enorm` |
//! | `pre_fc_norm_hidden` | `mtp.pre_fc_norm_hidden` | `hnorm` |
//! | `norm` | `mtp.norm` | `shared_head.norm` |
//! | the layer | `mtp.layers.0.*` | `model.layers.{L}.*` |
//!
//! (GLM also publishes copies of the embedding and the head in the NextN layer,
//! `embed_tokens` and `shared_head.head`; the head reads the target's instead.)
//!
//! The layer's tensors are the family's own decoder-layer tensors under the layout's prefix, so
//! the head is bound with the family's tensor table through a [`TensorMap`] that renames
//! `model.layers.{layer}.` to that prefix and `model.norm` to the head's norm: shapes, dtypes,
//! experts in either layout and published quantized formats are checked exactly as the
//! decoder's are, and every error names the checkpoint's tensor.

use crate::arch::{self, TensorMap};
use crate::config::ModelConfig;
use crate::error::{KylinError, Result};
use crate::family::{FfnKind, MixerKind};
use crate::safetensors_file::TensorIndex;
use crate::tensor::WeightTensor;
use crate::weights::ModelWeights;

/// The name that marks a checkpoint with a Qwen MTP head.
pub const MTP_FC: &str = "mtp.fc.weight";

/// Where a checkpoint keeps its head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Layout {
    /// Qwen3.5 and Qwen3-Next: `mtp.*`.
    Qwen,
    /// GLM-4.5 (and DeepSeek-V3): one more decoder layer, `model.layers.{layer}.*`, with
    /// `layer = num_hidden_layers`.
    NextN { layer: usize },
}

impl Layout {
    /// The layout of the head in `index`, if the checkpoint has one.
    pub(crate) fn of(config: &ModelConfig, index: &TensorIndex) -> Option<Layout> {
        if index.raw(MTP_FC).is_some() {
            return Some(Layout::Qwen);
        }
        let next = Layout::NextN { layer: config.num_layers };
        index.raw(&next.name("fc")).is_some().then_some(next)
    }

    /// The checkpoint's name of a part (`fc`, `pre_fc_norm_embedding`, `pre_fc_norm_hidden`,
    /// `norm`: the `.weight` tensors) or, for `layer`, the prefix of the head's layer.
    pub fn name(self, part: &str) -> String {
        match self {
            Layout::Qwen if part == "layer" => "mtp.layers.0.".to_string(),
            Layout::Qwen => format!("mtp.{part}.weight"),
            Layout::NextN { layer } => {
                let leaf = match part {
                    "fc" => "eh_proj",
                    "pre_fc_norm_embedding" => "enorm",
                    "pre_fc_norm_hidden" => "hnorm",
                    "norm" => "shared_head.norm",
                    _ => return format!("model.layers.{layer}."),
                };
                format!("model.layers.{layer}.{leaf}.weight")
            }
        }
    }
}

/// Whether the checkpoint tensor `name` belongs to a multi-token-prediction head of a decoder
/// of `num_layers` layers: `mtp.*`, or a NextN layer past the decoder's.
pub fn is_head_tensor(name: &str, num_layers: usize) -> bool {
    name.starts_with("mtp.")
        || name
            .strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|index| index.parse::<usize>().ok())
            .is_some_and(|index| index >= num_layers)
}

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
/// decoder's tensor map). `Ok(None)` when the checkpoint has neither `mtp.fc.weight` nor a
/// NextN layer's `eh_proj`.
///
/// `OPERATOR_UNSUPPORTED` for a family without MTP heads or a head of several layers;
/// `TENSOR_MISSING`, `TENSOR_SHAPE_MISMATCH` or `TENSOR_DTYPE_UNSUPPORTED` naming the
/// checkpoint's tensor otherwise.
pub(crate) fn bind(config: &ModelConfig, index: &TensorIndex, main: &TensorMap) -> Result<Option<MtpHead>> {
    let Some(layout) = Layout::of(config, index) else {
        return Ok(None);
    };
    let family = config.architecture.hf_name();
    // The head's layer is a full-attention layer of the family: the decoder's own kind.
    let Some(mut layer) = config.decoder.layers.iter().find(|l| l.mixer == MixerKind::Attention).copied() else {
        return Err(KylinError::operator_unsupported(format!(
            "{family} has no full-attention layer to take the MTP layer's shape from"
        )));
    };
    let recurrent = config.decoder.layers.iter().any(|l| l.mixer.is_recurrent());
    match layout {
        Layout::Qwen if !recurrent => {
            return Err(KylinError::operator_unsupported(format!(
                "the checkpoint has {MTP_FC}, but Kylin runs mtp.* heads of Qwen3.5, Qwen3.5-MoE and Qwen3-Next only, not \
                 of {family}"
            )));
        }
        Layout::NextN { .. } if recurrent => {
            return Err(KylinError::operator_unsupported(format!(
                "the checkpoint has a NextN layer ({}), but Kylin runs NextN layers of attention-only families, not of {family}",
                layout.name("fc")
            )));
        }
        _ => {}
    }
    match layout {
        Layout::Qwen => {
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
        }
        Layout::NextN { layer } => {
            // A second NextN layer would be `model.layers.{layer + 1}.*`.
            let further: std::collections::BTreeSet<usize> = index
                .names()
                .filter_map(|n| n.strip_prefix("model.layers.")?.split('.').next()?.parse::<usize>().ok())
                .filter(|&i| i > layer)
                .collect();
            if !further.is_empty() {
                return Err(KylinError::operator_unsupported(format!(
                    "the checkpoint has {} NextN layers (model.layers.{layer} to model.layers.{}); Kylin runs one, as \
                     GLM-4.5 publishes it",
                    further.len() + 1,
                    further.last().copied().unwrap_or(layer)
                )));
            }
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
    // The table's names, the decoder's layer moved under the head's prefix and the final norm
    // to the head's; the embedding and the head as the decoder binds them.
    let prefix = layout.name("layer");
    let renames = arch::table_names(config.architecture)
        .into_iter()
        .map(|name| {
            let to = if let Some(rest) = name.strip_prefix("model.layers.{layer}.") {
                format!("{prefix}{rest}")
            } else if name == "model.norm.weight" {
                layout.name("norm")
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
    let fc = vector(&layout.name("fc"), vec![hidden, 2 * hidden])?;
    let pre_fc_norm_embedding = vector(&layout.name("pre_fc_norm_embedding"), vec![hidden])?;
    let pre_fc_norm_hidden = vector(&layout.name("pre_fc_norm_hidden"), vec![hidden])?;
    // GLM's copies of the embedding and the head in its NextN layer: the head reads the
    // target's, so they count as the head's and are not reported unused.
    let copies = ["embed_tokens.weight", "shared_head.head.weight"]
        .into_iter()
        .map(|leaf| format!("{prefix}{leaf}"))
        .filter(|name| matches!(layout, Layout::NextN { .. }) && index.raw(name).is_some());
    let mut tensors: Vec<String> = bound
        .weights
        .tensors()
        .into_iter()
        .map(|t| t.name.clone())
        .filter(|n| is_head_tensor(n, config.num_layers))
        .chain([fc.name.clone(), pre_fc_norm_embedding.name.clone(), pre_fc_norm_hidden.name.clone()])
        .chain(copies)
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
