//! The bound model: every weight the engine needs, by role, checked against the config.

use std::collections::BTreeMap;

use crate::arch::Role;
use crate::tensor::WeightTensor;

/// One decoder layer's tensors by role (its family's table decides which roles exist).
/// Matrices are `[out_features, in_features]` as HF `nn.Linear` stores them; a fused
/// projection was split into its parts' roles when bound.
#[derive(Debug, Clone, Default)]
pub struct LayerWeights {
    pub tensors: BTreeMap<Role, WeightTensor>,
    /// Each routed expert's tensors by role (empty on a layer without experts). Stacked
    /// checkpoints' tensors are split into per-expert views when bound.
    pub experts: Vec<BTreeMap<Role, WeightTensor>>,
}

impl LayerWeights {
    /// The tensor of `role`, if the layer has one.
    pub fn get(&self, role: Role) -> Option<&WeightTensor> {
        self.tensors.get(&role)
    }

    /// The tensor of `role`; `TENSOR_MISSING` naming the role and layer when absent (the
    /// binding checked the table, so this only fails for a role the table does not have).
    pub fn require(&self, role: Role, layer: usize) -> crate::Result<&WeightTensor> {
        self.get(role).ok_or_else(|| {
            crate::KylinError::tensor_missing(format!(
                "layer {layer} has no {role:?} tensor in this architecture's table"
            ))
        })
    }

    /// The matrices of the layer's products, in role order, then the experts'.
    pub fn matrices(&self) -> impl Iterator<Item = &WeightTensor> {
        let experts = self.experts.iter().flat_map(|e| e.iter());
        self.tensors.iter().chain(experts).filter(|(r, _)| r.is_matrix()).map(|(_, t)| t)
    }

    /// Expert `e`'s tensor of `role`; `TENSOR_MISSING` naming them when absent.
    pub fn require_expert(&self, e: usize, role: Role, layer: usize) -> crate::Result<&WeightTensor> {
        self.experts.get(e).and_then(|m| m.get(&role)).ok_or_else(|| {
            crate::KylinError::tensor_missing(format!("layer {layer} has no {role:?} tensor for expert {e}"))
        })
    }
}

/// How the output head was bound, and why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HeadBinding {
    /// The head uses the embedding matrix.
    pub tied: bool,
    /// A sentence for `inspect`, e.g. "tie_word_embeddings is true; lm_head.weight is present
    /// but ignored, as transformers does".
    pub reason: String,
}

/// All weights of a decoder-only transformer.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// `[vocab, hidden]`.
    pub embed_tokens: WeightTensor,
    /// `[hidden]`.
    pub final_norm: WeightTensor,
    /// `[vocab, hidden]`; the same bytes as `embed_tokens` when tied.
    pub lm_head: WeightTensor,
    pub head: HeadBinding,
    /// The family's other model-wide tensors by role (Gemma 4's per-layer input embedding,
    /// projection and norm); empty for most families.
    pub globals: BTreeMap<Role, WeightTensor>,
    pub layers: Vec<LayerWeights>,
    /// For a quantized checkpoint (`ModelConfig::quantization`): each quantized matrix's
    /// `weight_scale` plane, keyed by its weight tensor's name.
    pub scales: std::collections::BTreeMap<String, WeightTensor>,
    /// For a published quantized checkpoint (`ModelConfig::published`): each quantized
    /// matrix's checked tensors, keyed by the name of its stored values tensor (`weight`,
    /// `weight_packed` or `qweight`), which is then the role's own tensor, not a float
    /// `[rows, cols]`.
    pub published: std::collections::BTreeMap<String, crate::published::PublishedMatrix>,
}

impl ModelWeights {
    /// The published quantized matrix whose stored values are `t` (a role's tensor), if any:
    /// found by the values tensor's name, then checked to be the same bytes (an indexed lookup:
    /// a MoE checkpoint has tens of thousands of matrices).
    pub fn published_matrix(&self, t: &WeightTensor) -> Option<&crate::published::PublishedMatrix> {
        self.published.get(&t.name).filter(|m| m.values.same_bytes(t))
    }

    /// The matrices of the matrix products: every layer's seven projections, then the head
    /// (the embedding's bytes when tied).
    pub fn matrices(&self) -> impl Iterator<Item = &WeightTensor> {
        self.layers.iter().flat_map(|l| l.matrices()).chain(std::iter::once(&self.lm_head))
    }

    /// Every bound tensor once (a tied head is the embedding, listed once).
    pub fn tensors(&self) -> Vec<&WeightTensor> {
        let mut out = vec![&self.embed_tokens, &self.final_norm];
        if !self.head.tied {
            out.push(&self.lm_head);
        }
        out.extend(self.globals.values());
        for l in &self.layers {
            out.extend(l.tensors.values());
            out.extend(l.experts.iter().flat_map(|e| e.values()));
        }
        out
    }
}
