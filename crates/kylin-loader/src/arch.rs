//! Declarative tensor tables: which checkpoint tensor fills which role, with which shape.
//!
//! One table per architecture (its family's `tensors`, `family/`), assembled from the shared
//! groups here (every entry exists once): embedding and head, the attention and MLP
//! projections (separate or fused), the norm placements (Llama's pre-norms, Gemma's sandwich,
//! OLMo 2's post-norms), biases and q/k norms. Names use `{layer}` for the layer index. Shapes
//! are functions of [`ModelConfig`]. A fused projection is split into its parts' roles at bind
//! time as views of row ranges (no copy), so the engine sees only `q_proj`, `gate_proj`, ...
//! Binding checks every required tensor (listing *all* missing ones at once), every shape and
//! every dtype, and reports the tensors the table did not use.
//!
//! A user tensor-map file (`LoadOptions::tensor_map`) renames entries for a checkpoint that
//! stores the same weights under other names:
//!
//! ```json
//! {"tensors": {"model.layers.{layer}.self_attn.q_proj.weight": "blocks.{layer}.attn.wq",
//!              "model.embed_tokens.weight": "tok_embeddings.weight"}}
//! ```
//!
//! Keys are table names (as listed by [`table_names`]); values are the names in the checkpoint.
//! A key with `{layer}` needs a value with `{layer}`. Any other shape of file, an unknown key or
//! a missing `{layer}` is `MAPPING_INVALID`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;

use crate::config::{Architecture, ModelConfig, StoredQuantization};
use crate::error::{KylinError, Result};
use crate::safetensors_file::TensorIndex;
use crate::tensor::DType;
use crate::tensor::WeightTensor;
use crate::weights::{HeadBinding, LayerWeights, ModelWeights};

/// A dimension named after the config value it comes from. Per-layer entries take the
/// layer's own sizes (`DecoderSpec::layers`), which differ between layers in Gemma 4.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Vocab,
    Hidden,
    /// `num_attention_heads * head_dim`.
    QDim,
    /// `num_key_value_heads * head_dim`.
    KvDim,
    HeadDim,
    Intermediate,
    /// `(num_attention_heads + 2 * num_key_value_heads) * head_dim` (a fused `qkv_proj`).
    QkvDim,
    /// `2 * intermediate_size` (a fused `gate_up_proj`).
    GateUpDim,
    /// A scalar stored as a one-element tensor (Gemma 4's `layer_scalar`).
    One,
    /// `hidden_size_per_layer_input` (Gemma 4).
    PerLayerInput,
    /// `num_hidden_layers * hidden_size_per_layer_input`: every layer's inputs side by side.
    AllLayerInputs,
    /// `vocab_size_per_layer_input`.
    PerLayerVocab,
    /// `num_attention_heads`.
    QHeads,
    /// The number of routed experts.
    Experts,
    /// One expert's width.
    ExpertInter,
    /// Twice one expert's width (gate and up fused).
    ExpertGateUp,
    /// The shared expert's width (Qwen2-MoE).
    SharedInter,
    /// `hidden_size / 32` and one expert's width / 32: MXFP4 blocks per row.
    HiddenBlocks,
    ExpertBlocks,
    /// 16 bytes: one MXFP4 block's codes.
    BlockBytes,
    /// `2 * num_attention_heads * head_dim`: a gated attention's `q_proj`, each head's queries
    /// followed by its gate (Qwen3.5).
    QGateDim,
    /// Gated DeltaNet's convolution channels, `2 * key_heads * key_head_dim + value_heads *
    /// value_head_dim` (its `in_proj_qkv` rows).
    LinearConvDim,
    /// `linear_num_value_heads * linear_value_head_dim`.
    LinearValueDim,
    /// `linear_num_value_heads`.
    LinearValueHeads,
    /// `linear_value_head_dim`.
    LinearValueHeadDim,
    /// `linear_conv_kernel_dim`.
    LinearConvKernel,
    /// Qwen3-Next's fused `in_proj_qkvz` rows: the convolution's channels and the output gate's,
    /// `2 · key_dim + 2 · value_dim`.
    LinearQkvzDim,
    /// Qwen3-Next's fused `in_proj_ba` rows, `2 · linear_num_value_heads`.
    LinearBaDim,
    /// `conv_L_cache` (LFM2's short convolution).
    ShortConvKernel,
    /// `3 * hidden_size` (LFM2's `conv.in_proj`: B, C and x).
    ThreeHidden,
}

/// The sizes that vary per layer: the layer's own, or the model's for global entries.
fn layer_sizes(c: &ModelConfig, layer: Option<usize>) -> (usize, usize, usize) {
    match layer.and_then(|i| c.decoder.layers.get(i)) {
        Some(l) => (l.head_dim, l.num_kv_heads, l.intermediate),
        None => (c.head_dim, c.num_kv_heads, c.intermediate_size),
    }
}

impl Dim {
    fn value(self, c: &ModelConfig, layer: Option<usize>) -> usize {
        let (head_dim, kv_heads, intermediate) = layer_sizes(c, layer);
        let per_layer = c.decoder.per_layer_input;
        match self {
            Dim::Vocab => c.vocab_size,
            Dim::Hidden => c.hidden_size,
            Dim::QDim => c.num_heads * head_dim,
            Dim::KvDim => kv_heads * head_dim,
            Dim::HeadDim => head_dim,
            Dim::Intermediate => intermediate,
            Dim::QkvDim => (c.num_heads + 2 * kv_heads) * head_dim,
            Dim::GateUpDim => 2 * intermediate,
            Dim::One => 1,
            Dim::PerLayerInput => per_layer.map_or(0, |p| p.width),
            Dim::AllLayerInputs => per_layer.map_or(0, |p| p.width * c.num_layers),
            Dim::PerLayerVocab => per_layer.map_or(0, |p| p.vocab),
            Dim::QHeads => c.num_heads,
            Dim::Experts => c.decoder.moe.map_or(0, |m| m.num_experts),
            Dim::ExpertInter => c.decoder.moe.map_or(0, |m| m.intermediate),
            Dim::ExpertGateUp => c.decoder.moe.map_or(0, |m| 2 * m.intermediate),
            Dim::SharedInter => c.decoder.moe.and_then(|m| m.shared_intermediate).unwrap_or(0),
            Dim::HiddenBlocks => c.hidden_size / 32,
            Dim::ExpertBlocks => c.decoder.moe.map_or(0, |m| m.intermediate / 32),
            Dim::BlockBytes => 16,
            Dim::QGateDim => 2 * c.num_heads * head_dim,
            Dim::LinearConvDim => c.decoder.linear_attention.map_or(0, |l| l.conv_dim()),
            Dim::LinearValueDim => c.decoder.linear_attention.map_or(0, |l| l.value_dim()),
            Dim::LinearValueHeads => c.decoder.linear_attention.map_or(0, |l| l.value_heads),
            Dim::LinearValueHeadDim => c.decoder.linear_attention.map_or(0, |l| l.value_head_dim),
            Dim::LinearConvKernel => c.decoder.linear_attention.map_or(0, |l| l.conv_kernel),
            Dim::LinearQkvzDim => c.decoder.linear_attention.map_or(0, |l| l.conv_dim() + l.value_dim()),
            Dim::LinearBaDim => c.decoder.linear_attention.map_or(0, |l| 2 * l.value_heads),
            Dim::ShortConvKernel => c.decoder.short_conv.map_or(0, |s| s.kernel),
            Dim::ThreeHidden => 3 * c.hidden_size,
        }
    }

    fn explain(self, c: &ModelConfig, layer: Option<usize>) -> String {
        let (head_dim, kv_heads, intermediate) = layer_sizes(c, layer);
        let per_layer = c.decoder.per_layer_input;
        let width = per_layer.map_or(0, |p| p.width);
        match self {
            Dim::Vocab => format!("vocab_size={}", c.vocab_size),
            Dim::Hidden => format!("hidden_size={}", c.hidden_size),
            Dim::QDim => format!("num_attention_heads={} * head_dim={head_dim}", c.num_heads),
            Dim::KvDim => format!("num_key_value_heads={kv_heads} * head_dim={head_dim}"),
            Dim::HeadDim => format!("head_dim={head_dim}"),
            Dim::Intermediate => format!("intermediate_size={intermediate}"),
            Dim::QkvDim => format!(
                "(num_attention_heads={} + 2 * num_key_value_heads={kv_heads}) * head_dim={head_dim}",
                c.num_heads
            ),
            Dim::GateUpDim => format!("2 * intermediate_size={intermediate}"),
            Dim::One => "a scalar".to_string(),
            Dim::PerLayerInput => format!("hidden_size_per_layer_input={width}"),
            Dim::AllLayerInputs => {
                format!("num_hidden_layers={} * hidden_size_per_layer_input={width}", c.num_layers)
            }
            Dim::PerLayerVocab => format!("vocab_size_per_layer_input={}", per_layer.map_or(0, |p| p.vocab)),
            Dim::QHeads => format!("num_attention_heads={}", c.num_heads),
            Dim::Experts => format!("num_experts={}", self.value(c, layer)),
            Dim::ExpertInter => format!("the expert width {}", self.value(c, layer)),
            Dim::ExpertGateUp => format!("2 * the expert width {}", self.value(c, layer) / 2),
            Dim::SharedInter => format!("shared_expert_intermediate_size={}", self.value(c, layer)),
            Dim::HiddenBlocks => format!("hidden_size={} / 32", c.hidden_size),
            Dim::ExpertBlocks => format!("the expert width {} / 32", self.value(c, layer) * 32),
            Dim::BlockBytes => "16 bytes per block".to_string(),
            Dim::QGateDim => format!("2 * num_attention_heads={} * head_dim={head_dim}", c.num_heads),
            Dim::LinearConvDim
            | Dim::LinearValueDim
            | Dim::LinearValueHeads
            | Dim::LinearValueHeadDim
            | Dim::LinearConvKernel
            | Dim::LinearQkvzDim
            | Dim::LinearBaDim => {
                let l = c.decoder.linear_attention;
                let (kh, vh, kd, vd, k) = l.map_or((0, 0, 0, 0, 0), |l| {
                    (l.key_heads, l.value_heads, l.key_head_dim, l.value_head_dim, l.conv_kernel)
                });
                match self {
                    Dim::LinearConvDim => format!(
                        "2 * linear_num_key_heads={kh} * linear_key_head_dim={kd} + linear_num_value_heads={vh} * linear_value_head_dim={vd}"
                    ),
                    Dim::LinearValueDim => {
                        format!("linear_num_value_heads={vh} * linear_value_head_dim={vd}")
                    }
                    Dim::LinearValueHeads => format!("linear_num_value_heads={vh}"),
                    Dim::LinearValueHeadDim => format!("linear_value_head_dim={vd}"),
                    Dim::LinearQkvzDim => format!(
                        "2 * linear_num_key_heads={kh} * linear_key_head_dim={kd} + 2 * linear_num_value_heads={vh} * linear_value_head_dim={vd}"
                    ),
                    Dim::LinearBaDim => format!("2 * linear_num_value_heads={vh}"),
                    _ => format!("linear_conv_kernel_dim={k}"),
                }
            }
            Dim::ShortConvKernel => format!("conv_L_cache={}", c.decoder.short_conv.map_or(0, |s| s.kernel)),
            Dim::ThreeHidden => format!("3 * hidden_size={}", c.hidden_size),
        }
    }
}

/// When an entry is required. Per-layer conditions hold only on the layers whose kind has the
/// tensor: the attention entries on attention layers, the MLP's on layers with a dense MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    Always,
    /// An attention layer's tensor.
    Attention,
    /// A dense MLP's tensor.
    DenseFfn,
    QkvBias,
    OBias,
    MlpBias,
    /// Only when the head is not tied (`lm_head.weight`).
    Untied,
    /// The layer projects its own keys: it does not reuse another layer's (Gemma 4).
    KvProjections,
    /// The layer has its own `v_proj` (not shared, values not the keys' projection).
    ValueProjection,
    /// `k_proj.bias` of a layer with its own keys.
    KBias,
    /// `v_proj.bias` of a layer with its own `v_proj`.
    VBias,
    /// The model has per-layer inputs (Gemma 4's `hidden_size_per_layer_input`).
    PerLayerInput,
    /// The layers carry a `layer_scalar` (Gemma 4).
    LayerScalar,
    /// A Gated DeltaNet layer's tensor.
    DeltaNet,
    /// A short-convolution layer's tensor.
    ShortConv,
    /// A short-convolution layer's bias (`conv_bias`).
    ShortConvBias,
    /// A layer with routed experts: its router.
    Router,
    /// The router's bias (gpt-oss).
    RouterBias,
    /// Gemma 4's router scales and the norms around its experts.
    Gemma4Router,
    /// LFM2-MoE's `expert_bias`, which only selects experts (`use_expert_bias`).
    RouterSelectionBias,
    /// One tensor per expert (`experts.{expert}.gate_proj.weight`): on layers with experts
    /// when the checkpoint stores them so.
    ExpertsSplit,
    /// Their biases (gpt-oss in this layout).
    ExpertBiasSplit,
    /// Experts stacked in 3-D tensors `[experts, out, in]` (`experts.gate_up_proj`).
    ExpertsStacked,
    /// Experts stacked input-major, `[experts, in, out]` (gpt-oss's BF16 layout).
    ExpertsStackedInputMajor,
    /// The stacked experts' biases `[experts, out]` (gpt-oss).
    ExpertBiasStacked,
    /// Experts stacked as MXFP4 `_blocks` and `_scales` (gpt-oss as published).
    ExpertsMxfp4,
    /// The shared expert (Qwen2-MoE, GLM-4.5).
    SharedExpert,
    /// The shared expert's sigmoid gate (Qwen2-MoE; not GLM-4.5).
    SharedExpertGate,
    /// Per-head attention sinks (gpt-oss).
    Sinks,
}

/// How a checkpoint stores its experts, decided once per binding from the tensors present.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpertLayout {
    /// One tensor per expert and projection, `[out, in]`.
    Split,
    /// 3-D tensors `[experts, out, in]`, gate and up fused (gate first, or interleaved where
    /// the family's activation says so).
    Stacked,
    /// 3-D tensors `[experts, in, out]` (gpt-oss as transformers saves it).
    StackedInputMajor,
    /// MXFP4 `_blocks` `[experts, out, in / 32, 16]` and `_scales` `[experts, out, in / 32]`
    /// (gpt-oss as published), gate and up interleaved by row.
    StackedMxfp4,
}

impl Cond {
    fn holds(self, c: &ModelConfig, layer: Option<usize>, experts: ExpertLayout) -> bool {
        let spec = layer.and_then(|i| c.decoder.layers.get(i));
        let attention = spec.is_none_or(|l| l.mixer == crate::family::MixerKind::Attention);
        let dense = spec.is_none_or(|l| l.ffn.has_mlp());
        let moe = c.decoder.moe.filter(|_| spec.is_some_and(|l| l.ffn.has_experts()));
        let layout = |l: ExpertLayout| moe.is_some() && experts == l;
        let mixer = |kind: crate::family::MixerKind| spec.is_some_and(|l| l.mixer == kind);
        let own_kv = attention && spec.is_none_or(|l| l.has_kv_projections());
        let own_v = attention && spec.is_none_or(|l| l.has_value_projection());
        match self {
            Cond::Always => true,
            Cond::Attention => attention,
            Cond::DenseFfn => dense,
            Cond::QkvBias => c.qkv_bias && attention,
            Cond::OBias => c.o_bias && attention,
            Cond::MlpBias => c.mlp_bias && dense,
            Cond::Untied => !c.tie_word_embeddings,
            Cond::KvProjections => own_kv,
            Cond::ValueProjection => own_v,
            Cond::KBias => c.qkv_bias && own_kv,
            Cond::VBias => c.qkv_bias && own_v,
            Cond::PerLayerInput => c.decoder.per_layer_input.is_some(),
            Cond::LayerScalar => c.decoder.layer_scalar,
            Cond::Router => moe.is_some(),
            Cond::RouterBias => moe.is_some_and(|m| m.router_bias),
            Cond::Gemma4Router => moe.is_some_and(|m| m.routing == crate::family::Routing::Gemma4),
            Cond::RouterSelectionBias => moe
                .is_some_and(|m| matches!(m.routing, crate::family::Routing::SigmoidTopK { selection_bias: true, .. })),
            Cond::ExpertsSplit => layout(ExpertLayout::Split),
            Cond::ExpertBiasSplit => layout(ExpertLayout::Split) && moe.is_some_and(|m| m.expert_bias),
            Cond::ExpertsStacked => layout(ExpertLayout::Stacked),
            Cond::ExpertsStackedInputMajor => layout(ExpertLayout::StackedInputMajor),
            Cond::ExpertBiasStacked => {
                (layout(ExpertLayout::Stacked)
                    || layout(ExpertLayout::StackedInputMajor)
                    || layout(ExpertLayout::StackedMxfp4))
                    && moe.is_some_and(|m| m.expert_bias)
            }
            Cond::ExpertsMxfp4 => layout(ExpertLayout::StackedMxfp4),
            Cond::SharedExpert => moe.is_some_and(|m| m.shared_intermediate.is_some()),
            Cond::SharedExpertGate => moe.is_some_and(|m| m.shared_intermediate.is_some() && m.shared_gated),
            Cond::Sinks => attention && c.decoder.attention_sinks,
            Cond::DeltaNet => mixer(crate::family::MixerKind::GatedDeltaNet),
            Cond::ShortConv => mixer(crate::family::MixerKind::ShortConv),
            Cond::ShortConvBias => {
                mixer(crate::family::MixerKind::ShortConv) && c.decoder.short_conv.is_some_and(|s| s.bias)
            }
        }
    }
}

/// The role a tensor plays in [`ModelWeights`] / [`LayerWeights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
    /// The norm after attention, before the residual add (Gemma, OLMo 2).
    PostAttnNorm,
    MlpNorm,
    /// The norm after the MLP, before the residual add (Gemma, OLMo 2).
    PostMlpNorm,
    GateProj,
    UpProj,
    DownProj,
    GateBias,
    UpBias,
    DownBias,
    /// `qkv_proj` (Phi-3): `q_proj`, `k_proj` and `v_proj` stacked by rows; split at bind time.
    QkvProj,
    /// `gate_up_proj` (Phi-3): `gate_proj` then `up_proj` by rows; split at bind time.
    GateUpProj,
    /// The multiplier of a layer's output, `[1]` (Gemma 4).
    LayerScalar,
    /// Gemma 4's per-layer input block: `per_layer_input_gate` `[width, hidden]`,
    /// `per_layer_projection` `[hidden, width]`, and the norm after it.
    PerLayerGate,
    PerLayerProjection,
    PostPerLayerNorm,
    /// Gemma 4's global per-layer input tensors: the second embedding
    /// `[vocab_per_layer, layers * width]`, the projection of the first embedding
    /// `[layers * width, hidden]`, and the norm of that projection `[width]`.
    EmbedPerLayer,
    PerLayerModelProjection,
    PerLayerProjectionNorm,
    /// Gated DeltaNet (`linear_attn.*`): `in_proj_qkv` `[conv_dim, hidden]`, `in_proj_z`
    /// `[value_dim, hidden]`, `in_proj_b` and `in_proj_a` `[value_heads, hidden]`, `conv1d`
    /// `[conv_dim, 1, kernel]`, `A_log` and `dt_bias` `[value_heads]`, the gated norm
    /// `[value_head_dim]` and `out_proj` `[hidden, value_dim]`.
    LinearQkvProj,
    LinearZProj,
    LinearBProj,
    LinearAProj,
    LinearConv,
    LinearALog,
    LinearDtBias,
    LinearNorm,
    LinearOutProj,
    /// Qwen3-Next's fused Gated DeltaNet projections, grouped per key head:
    /// `in_proj_qkvz` `[conv_dim + value_dim, hidden]` and `in_proj_ba` `[2 · value_heads, hidden]`.
    LinearQkvzProj,
    LinearBaProj,
    /// LFM2's short convolution (`conv.*`): `in_proj` `[3 hidden, hidden]`, `conv` `[hidden, 1,
    /// kernel]`, `out_proj` `[hidden, hidden]`, and their biases with `conv_bias`.
    ConvInProj,
    ConvWeight,
    ConvOutProj,
    ConvInBias,
    ConvBias,
    ConvOutBias,
    /// The Mixture-of-Experts router `[experts, hidden]` and its bias `[experts]`.
    Router,
    RouterBias,
    /// Gemma 4's router `scale` `[hidden]` and `per_expert_scale` `[experts]`.
    RouterScale,
    RouterExpertScale,
    /// LFM2-MoE's `expert_bias` `[experts]`: added to the router's sigmoids to choose the
    /// experts, not to weigh them.
    RouterSelectionBias,
    /// Gemma 4's norms around its two feed-forward branches: after the MLP, before and after
    /// the experts.
    PostMlpNorm1,
    PreExpertNorm,
    PostExpertNorm,
    /// One expert's projections (`LayerWeights::experts`), `[width, hidden]` and
    /// `[hidden, width]`, and their biases.
    ExpertGate,
    ExpertUp,
    ExpertDown,
    ExpertGateBias,
    ExpertUpBias,
    ExpertDownBias,
    /// One expert's gate and up fused, `[2 · width, hidden]`, and its bias; split from a
    /// stacked tensor.
    ExpertGateUp,
    ExpertGateUpBias,
    /// One expert's projections stored input-major (`[hidden, 2 · width]`, `[width, hidden]`):
    /// views of gpt-oss's stacked BF16 tensors, transposed when the model is built.
    ExpertGateUpInputMajor,
    ExpertDownInputMajor,
    /// The stacked tensors as stored, split into the roles above when bound.
    StackedGateUp,
    StackedDown,
    StackedGateUpInputMajor,
    StackedDownInputMajor,
    StackedGateUpBias,
    StackedDownBias,
    /// MXFP4 stacked experts: codes and scales of gate/up (interleaved rows) and down.
    StackedGateUpBlocks,
    StackedGateUpScales,
    StackedDownBlocks,
    StackedDownScales,
    /// Qwen2-MoE's shared expert and its gate `[1, hidden]`.
    SharedGate,
    SharedUp,
    SharedDown,
    SharedExpertGate,
    /// gpt-oss's attention sinks, one logit per query head.
    Sinks,
}

impl Role {
    /// Roles whose tensors hold packed bytes (U8) rather than floats: MXFP4 codes and scales.
    pub fn is_packed_bytes(self) -> bool {
        matches!(
            self,
            Role::StackedGateUpBlocks | Role::StackedGateUpScales | Role::StackedDownBlocks | Role::StackedDownScales
        )
    }
}

impl Role {
    /// The matrices of the matrix products (which a quantized checkpoint stores quantized).
    pub fn is_matrix(self) -> bool {
        matches!(
            self,
            Role::LmHead
                | Role::QProj
                | Role::KProj
                | Role::VProj
                | Role::OProj
                | Role::GateProj
                | Role::UpProj
                | Role::DownProj
                | Role::QkvProj
                | Role::GateUpProj
                | Role::LinearQkvProj
                | Role::LinearZProj
                | Role::LinearBProj
                | Role::LinearAProj
                | Role::LinearOutProj
                | Role::LinearQkvzProj
                | Role::LinearBaProj
                | Role::ConvInProj
                | Role::ConvOutProj
                | Role::ExpertGate
                | Role::ExpertUp
                | Role::ExpertDown
                | Role::SharedGate
                | Role::SharedUp
                | Role::SharedDown
        )
    }

    /// A per-expert role (`{expert}` in its name, or split from a stacked tensor).
    pub fn is_expert(self) -> bool {
        matches!(
            self,
            Role::ExpertGate
                | Role::ExpertUp
                | Role::ExpertDown
                | Role::ExpertGateBias
                | Role::ExpertUpBias
                | Role::ExpertDownBias
                | Role::ExpertGateUp
                | Role::ExpertGateUpBias
                | Role::ExpertGateUpInputMajor
                | Role::ExpertDownInputMajor
        )
    }

    /// A fused projection, split into its parts when bound.
    pub fn is_fused(self) -> bool {
        matches!(self, Role::QkvProj | Role::GateUpProj)
    }
}

/// One table entry.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub role: Role,
    /// The Hugging Face name; per-layer names contain `{layer}`.
    pub name: &'static str,
    pub shape: &'static [Dim],
    pub cond: Cond,
}

const fn spec(role: Role, name: &'static str, shape: &'static [Dim], cond: Cond) -> Spec {
    Spec { role, name, shape, cond }
}

use Dim::*;

/// The embedding, the final norm and the head.
pub const EMBED_HEAD: &[Spec] = &[
    spec(Role::Embed, "model.embed_tokens.weight", &[Vocab, Hidden], Cond::Always),
    spec(Role::FinalNorm, "model.norm.weight", &[Hidden], Cond::Always),
    spec(Role::LmHead, "lm_head.weight", &[Vocab, Hidden], Cond::Untied),
];

/// The four attention projections, stored apart.
pub const ATTENTION: &[Spec] = &[
    spec(Role::QProj, "model.layers.{layer}.self_attn.q_proj.weight", &[QDim, Hidden], Cond::Attention),
    spec(Role::KProj, "model.layers.{layer}.self_attn.k_proj.weight", &[KvDim, Hidden], Cond::Attention),
    spec(Role::VProj, "model.layers.{layer}.self_attn.v_proj.weight", &[KvDim, Hidden], Cond::Attention),
    spec(Role::OProj, "model.layers.{layer}.self_attn.o_proj.weight", &[Hidden, QDim], Cond::Attention),
];

/// q, k and v fused by rows (Phi-3's `qkv_proj`), and `o_proj`.
pub const FUSED_ATTENTION: &[Spec] = &[
    spec(Role::QkvProj, "model.layers.{layer}.self_attn.qkv_proj.weight", &[QkvDim, Hidden], Cond::Attention),
    spec(Role::OProj, "model.layers.{layer}.self_attn.o_proj.weight", &[Hidden, QDim], Cond::Attention),
];

/// The gated MLP's three projections, stored apart.
pub const MLP: &[Spec] = &[
    spec(Role::GateProj, "model.layers.{layer}.mlp.gate_proj.weight", &[Intermediate, Hidden], Cond::DenseFfn),
    spec(Role::UpProj, "model.layers.{layer}.mlp.up_proj.weight", &[Intermediate, Hidden], Cond::DenseFfn),
    spec(Role::DownProj, "model.layers.{layer}.mlp.down_proj.weight", &[Hidden, Intermediate], Cond::DenseFfn),
];

/// gate and up fused by rows (Phi-3's `gate_up_proj`), and `down_proj`.
pub const FUSED_MLP: &[Spec] = &[
    spec(Role::GateUpProj, "model.layers.{layer}.mlp.gate_up_proj.weight", &[GateUpDim, Hidden], Cond::DenseFfn),
    spec(Role::DownProj, "model.layers.{layer}.mlp.down_proj.weight", &[Hidden, Intermediate], Cond::DenseFfn),
];

/// Llama's pre-norms: before attention and before the MLP.
pub const PRE_NORMS: &[Spec] = &[
    spec(Role::AttnNorm, "model.layers.{layer}.input_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::MlpNorm, "model.layers.{layer}.post_attention_layernorm.weight", &[Hidden], Cond::Always),
];

/// Gemma's sandwich: a norm before and after each sub-block (note that Gemma's
/// `post_attention_layernorm` is a post-norm, where Llama's is the MLP's pre-norm).
pub const SANDWICH_NORMS: &[Spec] = &[
    spec(Role::AttnNorm, "model.layers.{layer}.input_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::PostAttnNorm, "model.layers.{layer}.post_attention_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::MlpNorm, "model.layers.{layer}.pre_feedforward_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::PostMlpNorm, "model.layers.{layer}.post_feedforward_layernorm.weight", &[Hidden], Cond::Always),
];

/// OLMo 2's post-norms only: after each sub-block, before the residual add.
pub const POST_NORMS: &[Spec] = &[
    spec(Role::PostAttnNorm, "model.layers.{layer}.post_attention_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::PostMlpNorm, "model.layers.{layer}.post_feedforward_layernorm.weight", &[Hidden], Cond::Always),
];

pub const QKV_BIAS: &[Spec] = &[
    spec(Role::QBias, "model.layers.{layer}.self_attn.q_proj.bias", &[QDim], Cond::QkvBias),
    spec(Role::KBias, "model.layers.{layer}.self_attn.k_proj.bias", &[KvDim], Cond::QkvBias),
    spec(Role::VBias, "model.layers.{layer}.self_attn.v_proj.bias", &[KvDim], Cond::QkvBias),
];

pub const O_BIAS: &[Spec] = &[spec(Role::OBias, "model.layers.{layer}.self_attn.o_proj.bias", &[Hidden], Cond::OBias)];

pub const MLP_BIAS: &[Spec] = &[
    spec(Role::GateBias, "model.layers.{layer}.mlp.gate_proj.bias", &[Intermediate], Cond::MlpBias),
    spec(Role::UpBias, "model.layers.{layer}.mlp.up_proj.bias", &[Intermediate], Cond::MlpBias),
    spec(Role::DownBias, "model.layers.{layer}.mlp.down_proj.bias", &[Hidden], Cond::MlpBias),
];

/// Per-head q/k norms (Qwen3, Gemma 3): one `(head_dim)` weight for every head.
pub const HEAD_QK_NORM: &[Spec] = &[
    spec(Role::QNorm, "model.layers.{layer}.self_attn.q_norm.weight", &[HeadDim], Cond::Attention),
    spec(Role::KNorm, "model.layers.{layer}.self_attn.k_norm.weight", &[HeadDim], Cond::Attention),
];

/// q/k norms over the whole projection (OLMo 2).
pub const PROJECTION_QK_NORM: &[Spec] = &[
    spec(Role::QNorm, "model.layers.{layer}.self_attn.q_norm.weight", &[QDim], Cond::Attention),
    spec(Role::KNorm, "model.layers.{layer}.self_attn.k_norm.weight", &[KvDim], Cond::Attention),
];

/// Gemma 4's attention: layers that reuse an earlier layer's keys and values have only
/// `q_proj`, `q_norm` and `o_proj`; full-attention layers with `attention_k_eq_v` have no
/// `v_proj`.
pub const SHARED_KV_ATTENTION: &[Spec] = &[
    spec(Role::QProj, "model.layers.{layer}.self_attn.q_proj.weight", &[QDim, Hidden], Cond::Attention),
    spec(Role::KProj, "model.layers.{layer}.self_attn.k_proj.weight", &[KvDim, Hidden], Cond::KvProjections),
    spec(Role::VProj, "model.layers.{layer}.self_attn.v_proj.weight", &[KvDim, Hidden], Cond::ValueProjection),
    spec(Role::OProj, "model.layers.{layer}.self_attn.o_proj.weight", &[Hidden, QDim], Cond::Attention),
    spec(Role::QNorm, "model.layers.{layer}.self_attn.q_norm.weight", &[HeadDim], Cond::Attention),
    spec(Role::KNorm, "model.layers.{layer}.self_attn.k_norm.weight", &[HeadDim], Cond::KvProjections),
];

/// Biases of [`SHARED_KV_ATTENTION`] (`attention_bias`).
pub const SHARED_KV_BIAS: &[Spec] = &[
    spec(Role::QBias, "model.layers.{layer}.self_attn.q_proj.bias", &[QDim], Cond::QkvBias),
    spec(Role::KBias, "model.layers.{layer}.self_attn.k_proj.bias", &[KvDim], Cond::KBias),
    spec(Role::VBias, "model.layers.{layer}.self_attn.v_proj.bias", &[KvDim], Cond::VBias),
    spec(Role::OBias, "model.layers.{layer}.self_attn.o_proj.bias", &[Hidden], Cond::OBias),
];

/// Gemma 4's per-layer inputs (global tensors and each layer's block) and layer scalars.
pub const PER_LAYER_INPUTS: &[Spec] = &[
    spec(
        Role::EmbedPerLayer,
        "model.embed_tokens_per_layer.weight",
        &[PerLayerVocab, AllLayerInputs],
        Cond::PerLayerInput,
    ),
    spec(
        Role::PerLayerModelProjection,
        "model.per_layer_model_projection.weight",
        &[AllLayerInputs, Hidden],
        Cond::PerLayerInput,
    ),
    spec(Role::PerLayerProjectionNorm, "model.per_layer_projection_norm.weight", &[PerLayerInput], Cond::PerLayerInput),
    spec(
        Role::PerLayerGate,
        "model.layers.{layer}.per_layer_input_gate.weight",
        &[PerLayerInput, Hidden],
        Cond::PerLayerInput,
    ),
    spec(
        Role::PerLayerProjection,
        "model.layers.{layer}.per_layer_projection.weight",
        &[Hidden, PerLayerInput],
        Cond::PerLayerInput,
    ),
    spec(
        Role::PostPerLayerNorm,
        "model.layers.{layer}.post_per_layer_input_norm.weight",
        &[Hidden],
        Cond::PerLayerInput,
    ),
];

/// Qwen3.5's gated attention: `q_proj` holds each head's queries followed by its output
/// gate; per-head q/k norms.
pub const GATED_ATTENTION: &[Spec] = &[
    spec(Role::QProj, "model.layers.{layer}.self_attn.q_proj.weight", &[QGateDim, Hidden], Cond::Attention),
    spec(Role::KProj, "model.layers.{layer}.self_attn.k_proj.weight", &[KvDim, Hidden], Cond::Attention),
    spec(Role::VProj, "model.layers.{layer}.self_attn.v_proj.weight", &[KvDim, Hidden], Cond::Attention),
    spec(Role::OProj, "model.layers.{layer}.self_attn.o_proj.weight", &[Hidden, QDim], Cond::Attention),
    spec(Role::QNorm, "model.layers.{layer}.self_attn.q_norm.weight", &[HeadDim], Cond::Attention),
    spec(Role::KNorm, "model.layers.{layer}.self_attn.k_norm.weight", &[HeadDim], Cond::Attention),
];

/// Gated DeltaNet's input projections as Qwen3.5 stores them, one matrix each: queries, keys
/// and values (`in_proj_qkv`), the output gate `z`, `b` and `a`.
pub const DELTA_NET_PROJECTIONS: &[Spec] = &[
    spec(
        Role::LinearQkvProj,
        "model.layers.{layer}.linear_attn.in_proj_qkv.weight",
        &[LinearConvDim, Hidden],
        Cond::DeltaNet,
    ),
    spec(
        Role::LinearZProj,
        "model.layers.{layer}.linear_attn.in_proj_z.weight",
        &[LinearValueDim, Hidden],
        Cond::DeltaNet,
    ),
    spec(
        Role::LinearBProj,
        "model.layers.{layer}.linear_attn.in_proj_b.weight",
        &[LinearValueHeads, Hidden],
        Cond::DeltaNet,
    ),
    spec(
        Role::LinearAProj,
        "model.layers.{layer}.linear_attn.in_proj_a.weight",
        &[LinearValueHeads, Hidden],
        Cond::DeltaNet,
    ),
];

/// Gated DeltaNet's input projections as Qwen3-Next stores them: `in_proj_qkvz`
/// `[key_heads · (2 · key_head_dim + 2 · group · value_head_dim), hidden]` and `in_proj_ba`
/// `[key_heads · 2 · group, hidden]`, rows grouped per key head (`group` = value heads per key
/// head): each group's q, k, v, z (and b, a) in turn.
pub const DELTA_NET_GROUPED_PROJECTIONS: &[Spec] = &[
    spec(
        Role::LinearQkvzProj,
        "model.layers.{layer}.linear_attn.in_proj_qkvz.weight",
        &[LinearQkvzDim, Hidden],
        Cond::DeltaNet,
    ),
    spec(
        Role::LinearBaProj,
        "model.layers.{layer}.linear_attn.in_proj_ba.weight",
        &[LinearBaDim, Hidden],
        Cond::DeltaNet,
    ),
];

/// Gated DeltaNet (`linear_attn`) past its input projections, on its layers: the convolution,
/// the decay's parameters, the gated norm and the output projection.
pub const GATED_DELTA_NET: &[Spec] = &[
    spec(
        Role::LinearConv,
        "model.layers.{layer}.linear_attn.conv1d.weight",
        &[LinearConvDim, One, LinearConvKernel],
        Cond::DeltaNet,
    ),
    spec(Role::LinearALog, "model.layers.{layer}.linear_attn.A_log", &[LinearValueHeads], Cond::DeltaNet),
    spec(Role::LinearDtBias, "model.layers.{layer}.linear_attn.dt_bias", &[LinearValueHeads], Cond::DeltaNet),
    spec(Role::LinearNorm, "model.layers.{layer}.linear_attn.norm.weight", &[LinearValueHeadDim], Cond::DeltaNet),
    spec(
        Role::LinearOutProj,
        "model.layers.{layer}.linear_attn.out_proj.weight",
        &[Hidden, LinearValueDim],
        Cond::DeltaNet,
    ),
];

/// LFM2: the embedding, the final norm (`embedding_norm`, applied after the layers) and the
/// head.
pub const LFM2_EMBED_HEAD: &[Spec] = &[
    spec(Role::Embed, "model.embed_tokens.weight", &[Vocab, Hidden], Cond::Always),
    spec(Role::FinalNorm, "model.embedding_norm.weight", &[Hidden], Cond::Always),
    spec(Role::LmHead, "lm_head.weight", &[Vocab, Hidden], Cond::Untied),
];

/// LFM2's norms: before the mixer (`operator_norm`) and before the MLP (`ffn_norm`).
pub const LFM2_NORMS: &[Spec] = &[
    spec(Role::AttnNorm, "model.layers.{layer}.operator_norm.weight", &[Hidden], Cond::Always),
    spec(Role::MlpNorm, "model.layers.{layer}.ffn_norm.weight", &[Hidden], Cond::Always),
];

/// LFM2's attention: `out_proj`, per-head `q_layernorm` and `k_layernorm`.
pub const LFM2_ATTENTION: &[Spec] = &[
    spec(Role::QProj, "model.layers.{layer}.self_attn.q_proj.weight", &[QDim, Hidden], Cond::Attention),
    spec(Role::KProj, "model.layers.{layer}.self_attn.k_proj.weight", &[KvDim, Hidden], Cond::Attention),
    spec(Role::VProj, "model.layers.{layer}.self_attn.v_proj.weight", &[KvDim, Hidden], Cond::Attention),
    spec(Role::OProj, "model.layers.{layer}.self_attn.out_proj.weight", &[Hidden, QDim], Cond::Attention),
    spec(Role::QNorm, "model.layers.{layer}.self_attn.q_layernorm.weight", &[HeadDim], Cond::Attention),
    spec(Role::KNorm, "model.layers.{layer}.self_attn.k_layernorm.weight", &[HeadDim], Cond::Attention),
];

/// LFM2's gated MLP (`feed_forward`: `w1` gate, `w3` up, `w2` down).
pub const LFM2_MLP: &[Spec] = &[
    spec(Role::GateProj, "model.layers.{layer}.feed_forward.w1.weight", &[Intermediate, Hidden], Cond::DenseFfn),
    spec(Role::UpProj, "model.layers.{layer}.feed_forward.w3.weight", &[Intermediate, Hidden], Cond::DenseFfn),
    spec(Role::DownProj, "model.layers.{layer}.feed_forward.w2.weight", &[Hidden, Intermediate], Cond::DenseFfn),
];

/// LFM2-MoE's feed-forward block on its sparse layers (`feed_forward`): the router `gate`,
/// the selection bias `expert_bias`, and the experts `w1` (gate), `w3` (up), `w2` (down), one
/// tensor per expert as published, or stacked as transformers holds them in memory.
pub const LFM2_MOE: &[Spec] = &[
    spec(Role::Router, "model.layers.{layer}.feed_forward.gate.weight", &[Experts, Hidden], Cond::Router),
    spec(
        Role::RouterSelectionBias,
        "model.layers.{layer}.feed_forward.expert_bias",
        &[Experts],
        Cond::RouterSelectionBias,
    ),
    spec(
        Role::ExpertGate,
        "model.layers.{layer}.feed_forward.experts.{expert}.w1.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertUp,
        "model.layers.{layer}.feed_forward.experts.{expert}.w3.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertDown,
        "model.layers.{layer}.feed_forward.experts.{expert}.w2.weight",
        &[Hidden, ExpertInter],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::StackedGateUp,
        "model.layers.{layer}.feed_forward.experts.gate_up_proj",
        &[Experts, ExpertGateUp, Hidden],
        Cond::ExpertsStacked,
    ),
    spec(
        Role::StackedDown,
        "model.layers.{layer}.feed_forward.experts.down_proj",
        &[Experts, Hidden, ExpertInter],
        Cond::ExpertsStacked,
    ),
];

/// LFM2's short convolution, on its layers.
pub const SHORT_CONV: &[Spec] = &[
    spec(Role::ConvInProj, "model.layers.{layer}.conv.in_proj.weight", &[ThreeHidden, Hidden], Cond::ShortConv),
    spec(Role::ConvWeight, "model.layers.{layer}.conv.conv.weight", &[Hidden, One, ShortConvKernel], Cond::ShortConv),
    spec(Role::ConvOutProj, "model.layers.{layer}.conv.out_proj.weight", &[Hidden, Hidden], Cond::ShortConv),
    spec(Role::ConvInBias, "model.layers.{layer}.conv.in_proj.bias", &[ThreeHidden], Cond::ShortConvBias),
    spec(Role::ConvBias, "model.layers.{layer}.conv.conv.bias", &[Hidden], Cond::ShortConvBias),
    spec(Role::ConvOutBias, "model.layers.{layer}.conv.out_proj.bias", &[Hidden], Cond::ShortConvBias),
];

pub const LAYER_SCALAR: &[Spec] =
    &[spec(Role::LayerScalar, "model.layers.{layer}.layer_scalar", &[One], Cond::LayerScalar)];

/// The Mixture-of-Experts router under `mlp.gate` (Qwen-MoE, OLMoE).
pub const MLP_ROUTER: &[Spec] =
    &[spec(Role::Router, "model.layers.{layer}.mlp.gate.weight", &[Experts, Hidden], Cond::Router)];

/// Experts under `mlp.experts`: one tensor per expert and projection, or stacked 3-D tensors
/// (gate and up fused, gate first), whichever the checkpoint has.
pub const MLP_EXPERTS: &[Spec] = &[
    spec(
        Role::ExpertGate,
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertUp,
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertDown,
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        &[Hidden, ExpertInter],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::StackedGateUp,
        "model.layers.{layer}.mlp.experts.gate_up_proj",
        &[Experts, ExpertGateUp, Hidden],
        Cond::ExpertsStacked,
    ),
    spec(
        Role::StackedDown,
        "model.layers.{layer}.mlp.experts.down_proj",
        &[Experts, Hidden, ExpertInter],
        Cond::ExpertsStacked,
    ),
];

/// Qwen2-MoE's shared expert and its sigmoid gate.
pub const SHARED_EXPERT: &[Spec] = &[
    spec(
        Role::SharedGate,
        "model.layers.{layer}.mlp.shared_expert.gate_proj.weight",
        &[SharedInter, Hidden],
        Cond::SharedExpert,
    ),
    spec(
        Role::SharedUp,
        "model.layers.{layer}.mlp.shared_expert.up_proj.weight",
        &[SharedInter, Hidden],
        Cond::SharedExpert,
    ),
    spec(
        Role::SharedDown,
        "model.layers.{layer}.mlp.shared_expert.down_proj.weight",
        &[Hidden, SharedInter],
        Cond::SharedExpert,
    ),
    spec(
        Role::SharedExpertGate,
        "model.layers.{layer}.mlp.shared_expert_gate.weight",
        &[One, Hidden],
        Cond::SharedExpertGate,
    ),
];

/// GLM-4.5's router (DeepSeek-V3's): `mlp.gate.weight` and the selection bias
/// `e_score_correction_bias` (float32 as published).
pub const GLM4_MOE_ROUTER: &[Spec] = &[
    spec(Role::Router, "model.layers.{layer}.mlp.gate.weight", &[Experts, Hidden], Cond::Router),
    spec(
        Role::RouterSelectionBias,
        "model.layers.{layer}.mlp.gate.e_score_correction_bias",
        &[Experts],
        Cond::RouterSelectionBias,
    ),
];

/// GLM-4.5's shared experts (`mlp.shared_experts`, plural; `n_shared_experts` of them fused into
/// one MLP of `n_shared_experts · moe_intermediate_size`), without a gate.
pub const SHARED_EXPERTS: &[Spec] = &[
    spec(
        Role::SharedGate,
        "model.layers.{layer}.mlp.shared_experts.gate_proj.weight",
        &[SharedInter, Hidden],
        Cond::SharedExpert,
    ),
    spec(
        Role::SharedUp,
        "model.layers.{layer}.mlp.shared_experts.up_proj.weight",
        &[SharedInter, Hidden],
        Cond::SharedExpert,
    ),
    spec(
        Role::SharedDown,
        "model.layers.{layer}.mlp.shared_experts.down_proj.weight",
        &[Hidden, SharedInter],
        Cond::SharedExpert,
    ),
];

/// Mixtral's `block_sparse_moe`: router and experts `w1` (gate), `w3` (up), `w2` (down).
pub const BLOCK_SPARSE_MOE: &[Spec] = &[
    spec(Role::Router, "model.layers.{layer}.block_sparse_moe.gate.weight", &[Experts, Hidden], Cond::Router),
    spec(
        Role::ExpertGate,
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertUp,
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertDown,
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",
        &[Hidden, ExpertInter],
        Cond::ExpertsSplit,
    ),
];

/// gpt-oss: a router with a bias; experts stacked input-major with gate and up interleaved
/// (`[E, hidden, 2w]`, `[E, w, hidden]`) and biases, or one tensor per expert `[out, in]`.
pub const GPT_OSS_EXPERTS: &[Spec] = &[
    spec(Role::Router, "model.layers.{layer}.mlp.router.weight", &[Experts, Hidden], Cond::Router),
    spec(Role::RouterBias, "model.layers.{layer}.mlp.router.bias", &[Experts], Cond::RouterBias),
    spec(
        Role::StackedGateUpInputMajor,
        "model.layers.{layer}.mlp.experts.gate_up_proj",
        &[Experts, Hidden, ExpertGateUp],
        Cond::ExpertsStackedInputMajor,
    ),
    spec(
        Role::StackedDownInputMajor,
        "model.layers.{layer}.mlp.experts.down_proj",
        &[Experts, ExpertInter, Hidden],
        Cond::ExpertsStackedInputMajor,
    ),
    spec(
        Role::StackedGateUpBias,
        "model.layers.{layer}.mlp.experts.gate_up_proj_bias",
        &[Experts, ExpertGateUp],
        Cond::ExpertBiasStacked,
    ),
    spec(
        Role::StackedDownBias,
        "model.layers.{layer}.mlp.experts.down_proj_bias",
        &[Experts, Hidden],
        Cond::ExpertBiasStacked,
    ),
    spec(
        Role::StackedGateUpBlocks,
        "model.layers.{layer}.mlp.experts.gate_up_proj_blocks",
        &[Experts, ExpertGateUp, HiddenBlocks, BlockBytes],
        Cond::ExpertsMxfp4,
    ),
    spec(
        Role::StackedGateUpScales,
        "model.layers.{layer}.mlp.experts.gate_up_proj_scales",
        &[Experts, ExpertGateUp, HiddenBlocks],
        Cond::ExpertsMxfp4,
    ),
    spec(
        Role::StackedDownBlocks,
        "model.layers.{layer}.mlp.experts.down_proj_blocks",
        &[Experts, Hidden, ExpertBlocks, BlockBytes],
        Cond::ExpertsMxfp4,
    ),
    spec(
        Role::StackedDownScales,
        "model.layers.{layer}.mlp.experts.down_proj_scales",
        &[Experts, Hidden, ExpertBlocks],
        Cond::ExpertsMxfp4,
    ),
    spec(
        Role::ExpertGate,
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertUp,
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertDown,
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",
        &[Hidden, ExpertInter],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertGateBias,
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.bias",
        &[ExpertInter],
        Cond::ExpertBiasSplit,
    ),
    spec(
        Role::ExpertUpBias,
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.bias",
        &[ExpertInter],
        Cond::ExpertBiasSplit,
    ),
    spec(
        Role::ExpertDownBias,
        "model.layers.{layer}.mlp.experts.{expert}.down_proj.bias",
        &[Hidden],
        Cond::ExpertBiasSplit,
    ),
];

/// gpt-oss's per-head attention sinks.
pub const SINKS: &[Spec] = &[spec(Role::Sinks, "model.layers.{layer}.self_attn.sinks", &[QHeads], Cond::Sinks)];

/// Gemma 4's experts beside its MLP: the router (`proj`, `scale`, `per_expert_scale`), the
/// norms around the two branches, and the experts, stacked or one tensor per expert.
pub const GEMMA4_EXPERTS: &[Spec] = &[
    spec(Role::Router, "model.layers.{layer}.router.proj.weight", &[Experts, Hidden], Cond::Router),
    spec(Role::RouterScale, "model.layers.{layer}.router.scale", &[Hidden], Cond::Gemma4Router),
    spec(Role::RouterExpertScale, "model.layers.{layer}.router.per_expert_scale", &[Experts], Cond::Gemma4Router),
    spec(Role::PostMlpNorm1, "model.layers.{layer}.post_feedforward_layernorm_1.weight", &[Hidden], Cond::Gemma4Router),
    spec(Role::PreExpertNorm, "model.layers.{layer}.pre_feedforward_layernorm_2.weight", &[Hidden], Cond::Gemma4Router),
    spec(
        Role::PostExpertNorm,
        "model.layers.{layer}.post_feedforward_layernorm_2.weight",
        &[Hidden],
        Cond::Gemma4Router,
    ),
    spec(
        Role::StackedGateUp,
        "model.layers.{layer}.experts.gate_up_proj",
        &[Experts, ExpertGateUp, Hidden],
        Cond::ExpertsStacked,
    ),
    spec(
        Role::StackedDown,
        "model.layers.{layer}.experts.down_proj",
        &[Experts, Hidden, ExpertInter],
        Cond::ExpertsStacked,
    ),
    spec(
        Role::ExpertGate,
        "model.layers.{layer}.experts.{expert}.gate_proj.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertUp,
        "model.layers.{layer}.experts.{expert}.up_proj.weight",
        &[ExpertInter, Hidden],
        Cond::ExpertsSplit,
    ),
    spec(
        Role::ExpertDown,
        "model.layers.{layer}.experts.{expert}.down_proj.weight",
        &[Hidden, ExpertInter],
        Cond::ExpertsSplit,
    ),
];

/// The registry: each architecture's table as a list of groups.
fn groups(arch: Architecture) -> &'static [&'static [Spec]] {
    arch.family().tensors
}

/// The table of an architecture.
pub fn table(arch: Architecture) -> Vec<Spec> {
    groups(arch).iter().flat_map(|g| g.iter().copied()).collect()
}

/// The checkpoint name of `role` in `arch`'s table, with `{layer}` filled in for per-layer
/// roles; `None` if the table has no such role.
pub fn tensor_name(arch: Architecture, role: Role, layer: usize) -> Option<String> {
    let spec = table(arch).into_iter().find(|s| s.role == role)?;
    Some(spec.name.replace("{layer}", &layer.to_string()))
}

/// The table names a tensor-map file may use for `arch`.
pub fn table_names(arch: Architecture) -> Vec<&'static str> {
    table(arch).iter().map(|s| s.name).collect()
}

/// A parsed tensor-map file: table name → checkpoint name.
#[derive(Debug, Clone, Default)]
pub struct TensorMap {
    pub renames: BTreeMap<String, String>,
}

impl TensorMap {
    /// Reads and checks a tensor-map file against `arch`'s table.
    pub fn load(path: &Path, arch: Architecture) -> Result<TensorMap> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            let mut err = KylinError::io(path, "cannot read tensor map", &e);
            if err.code != crate::error::ErrorCode::FileNotFound {
                err.code = crate::error::ErrorCode::MappingInvalid;
            }
            err
        })?;
        Self::parse(&text, arch).map_err(|e| e.at(path))
    }

    /// Parses tensor-map JSON; every problem is `MAPPING_INVALID`.
    pub fn parse(text: &str, arch: Architecture) -> Result<TensorMap> {
        let invalid = |what: String| KylinError::mapping_invalid(format!("tensor map: {what}"));
        let value: Value = serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON ({e})")))?;
        let Value::Object(top) = value else {
            return Err(invalid("expected an object {\"tensors\": {...}}".into()));
        };
        if let Some(k) = top.keys().find(|k| k.as_str() != "tensors") {
            return Err(invalid(format!("unknown key '{k}'; the only key is 'tensors'")));
        }
        let Some(Value::Object(entries)) = top.get("tensors") else {
            return Err(invalid("'tensors' must be an object of table name -> checkpoint name".into()));
        };
        let known = table_names(arch);
        let mut renames = BTreeMap::new();
        for (key, v) in entries {
            if !known.contains(&key.as_str()) {
                return Err(invalid(format!(
                    "'{key}' is not a table name of {}; table names: {}",
                    arch.hf_name(),
                    known.join(", ")
                )));
            }
            let to = v
                .as_str()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| invalid(format!("the value for '{key}' must be a non-empty checkpoint tensor name")))?;
            if key.contains("{layer}") != to.contains("{layer}") {
                return Err(invalid(format!(
                    "'{key}' -> '{to}': a per-layer name needs '{{layer}}' on both sides, a global one on neither"
                )));
            }
            renames.insert(key.clone(), to.to_string());
        }
        Ok(TensorMap { renames })
    }

    /// The names of a vision-language checkpoint's language model: transformers 5 stores it
    /// under `model.language_model.` (head `lm_head.weight`), transformers 4 under
    /// `language_model.model.` (head `language_model.lm_head.weight`); the layout is
    /// recognised by where the embedding is.
    pub(crate) fn language_model(arch: Architecture, index: &TensorIndex) -> TensorMap {
        let (prefix, head) = if index.raw("language_model.model.embed_tokens.weight").is_some() {
            ("language_model.model.", "language_model.lm_head.weight")
        } else {
            ("model.language_model.", "lm_head.weight")
        };
        let renames = table_names(arch)
            .into_iter()
            .map(|name| {
                let to = match name.strip_prefix("model.") {
                    Some(rest) => format!("{prefix}{rest}"),
                    None if name == "lm_head.weight" => head.to_string(),
                    None => name.to_string(),
                };
                (name.to_string(), to)
            })
            .collect();
        TensorMap { renames }
    }

    /// True when the checkpoint was saved from the bare `*Model` (no `model.` prefix), as
    /// Qwen3-Embedding is published.
    pub(crate) fn is_bare_model(index: &TensorIndex) -> bool {
        index.raw("embed_tokens.weight").is_some() && index.raw("model.embed_tokens.weight").is_none()
    }

    /// The names of a checkpoint saved from the bare `*Model`: the table's `model.X` is `X`
    /// (the head, if any, keeps its name).
    pub(crate) fn bare_model(arch: Architecture) -> TensorMap {
        let renames = table_names(arch)
            .into_iter()
            .filter_map(|name| name.strip_prefix("model.").map(|rest| (name.to_string(), rest.to_string())))
            .collect();
        TensorMap { renames }
    }

    pub(crate) fn name_for(&self, table_name: &str) -> String {
        self.renames.get(table_name).cloned().unwrap_or_else(|| table_name.to_string())
    }
}

/// The result of binding: the weights and the checkpoint tensors nobody asked for.
pub(crate) struct Bound {
    pub weights: ModelWeights,
    pub unused: Vec<String>,
}

fn shape_text(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

/// Replaces a layer's fused projections by views of their parts' rows (no copy):
/// `qkv_proj` `[q + 2 kv, hidden]` → `q_proj` `[q, hidden]`, `k_proj`, `v_proj`;
/// `gate_up_proj` `[2 i, hidden]` → `gate_proj` `[i, hidden]`, `up_proj` (transformers'
/// `chunk(2)`: gate first). The parts are named after the unfused checkpoints' tensors.
fn split_fused(config: &ModelConfig, layer: usize, tensors: &mut BTreeMap<Role, WeightTensor>) -> Result<()> {
    let (head_dim, kv_heads, inter) = layer_sizes(config, Some(layer));
    let (q, kv) = (config.num_heads * head_dim, kv_heads * head_dim);
    let mut split = |fused: Role, parts: &[(Role, usize, &str)]| -> Result<()> {
        let Some(t) = tensors.remove(&fused) else { return Ok(()) };
        let mut row = 0;
        for &(role, rows, part) in parts {
            let name = t.name.replace(if fused == Role::QkvProj { "qkv_proj" } else { "gate_up_proj" }, part);
            let view = t.rows(row, row + rows, name).ok_or_else(|| {
                KylinError::tensor_shape_mismatch(format!(
                    "tensor '{}' ({:?}) cannot be split into rows {row}..{}",
                    t.name,
                    t.shape,
                    row + rows
                ))
            })?;
            tensors.insert(role, view);
            row += rows;
        }
        Ok(())
    };
    split(Role::QkvProj, &[(Role::QProj, q, "q_proj"), (Role::KProj, kv, "k_proj"), (Role::VProj, kv, "v_proj")])?;
    split(Role::GateUpProj, &[(Role::GateProj, inter, "gate_proj"), (Role::UpProj, inter, "up_proj")])?;
    Ok(())
}

/// How the checkpoint stores its experts: stacked when the first layer with experts has the
/// stacked gate/up tensor of the family's table, input-major stacked when it has that one,
/// else one tensor per expert.
fn expert_layout(config: &ModelConfig, specs: &[Spec], index: &TensorIndex, map: &TensorMap) -> ExpertLayout {
    let Some(first) = config.decoder.layers.iter().position(|l| l.ffn.has_experts()) else {
        return ExpertLayout::Split;
    };
    let present = |role: Role| {
        specs.iter().filter(|s| s.role == role).any(|s| {
            let name = map.name_for(s.name).replace("{layer}", &first.to_string());
            index.raw(&name).is_some()
        })
    };
    if present(Role::StackedGateUpBlocks) {
        ExpertLayout::StackedMxfp4
    } else if present(Role::StackedGateUp) {
        ExpertLayout::Stacked
    } else if present(Role::StackedGateUpInputMajor) {
        ExpertLayout::StackedInputMajor
    } else {
        ExpertLayout::Split
    }
}

/// Splits a layer's stacked expert tensors (`[experts, ...]`) into per-expert views (no copy):
/// `gate_up_proj` `[E, 2w, hidden]` → each expert's `ExpertGateUp` `[2w, hidden]`, `down_proj`
/// `[E, hidden, w]` → `ExpertDown`, their biases likewise; the input-major ones of gpt-oss into
/// `ExpertGateUpInputMajor` `[hidden, 2w]` and `ExpertDownInputMajor` `[w, hidden]`.
fn split_stacked(
    config: &ModelConfig,
    layer: usize,
    tensors: &mut BTreeMap<Role, WeightTensor>,
    experts: &mut [BTreeMap<Role, WeightTensor>],
    published: &mut BTreeMap<String, crate::published::PublishedMatrix>,
) -> Result<()> {
    let pairs = [
        (Role::StackedGateUp, Role::ExpertGateUp),
        (Role::StackedDown, Role::ExpertDown),
        (Role::StackedGateUpInputMajor, Role::ExpertGateUpInputMajor),
        (Role::StackedDownInputMajor, Role::ExpertDownInputMajor),
        (Role::StackedGateUpBias, Role::ExpertGateUpBias),
        (Role::StackedDownBias, Role::ExpertDownBias),
    ];
    let entry = |t: &WeightTensor, e: usize| {
        t.entry(e, format!("{}[{e}]", t.name)).ok_or_else(|| {
            KylinError::tensor_shape_mismatch(format!(
                "tensor '{}' ({:?}) has no entry for expert {e}",
                t.name, t.shape
            ))
        })
    };
    for (stacked, part) in pairs {
        let Some(t) = tensors.remove(&stacked) else { continue };
        for (e, map) in experts.iter_mut().enumerate() {
            map.insert(part, entry(&t, e)?);
        }
    }
    // MXFP4: each expert's codes and scales become a published matrix (decoded when the model
    // is built), its codes the role's tensor.
    let width = config.decoder.moe.map_or(0, |m| m.intermediate);
    let mxfp4 = [
        (
            Role::StackedGateUpBlocks,
            Role::StackedGateUpScales,
            Role::ExpertGateUp,
            "gate_up_proj",
            2 * width,
            config.hidden_size,
        ),
        (Role::StackedDownBlocks, Role::StackedDownScales, Role::ExpertDown, "down_proj", config.hidden_size, width),
    ];
    for (blocks_role, scales_role, part, name, rows, cols) in mxfp4 {
        let (Some(blocks), Some(scales)) = (tensors.remove(&blocks_role), tensors.remove(&scales_role)) else {
            continue;
        };
        for (e, map) in experts.iter_mut().enumerate() {
            let values = entry(&blocks, e)?;
            let matrix = crate::published::PublishedMatrix {
                module: format!("model.layers.{layer}.mlp.experts.{name}[{e}]"),
                rows,
                cols,
                scheme: crate::published::Scheme::Mxfp4,
                values: values.clone(),
                scale: entry(&scales, e)?,
                zero: None,
                g_idx: None,
                shape: None,
                int8_activations: false,
                input: None,
                input_scale: None,
            };
            published.insert(values.name.clone(), matrix);
            map.insert(part, values);
        }
    }
    Ok(())
}

/// Takes a bound required role out of `found`.
pub(crate) fn take(
    found: &mut BTreeMap<(usize, Role), WeightTensor>,
    layer: usize,
    role: Role,
) -> Result<WeightTensor> {
    found.remove(&(layer, role)).ok_or_else(|| {
        // Unreachable by construction: every required role was checked before this is called.
        KylinError::tensor_missing(format!("internal: role {role:?} of layer {layer} was not bound"))
    })
}

/// Binds every role of `config.architecture`'s table to a tensor of `index`.
pub(crate) fn bind(config: &ModelConfig, index: &TensorIndex, map: &TensorMap) -> Result<Bound> {
    let specs = table(config.architecture);
    let layout = expert_layout(config, &specs, index, map);
    let mut missing: Vec<String> = Vec::new();
    let mut shape_errors: Vec<String> = Vec::new();
    let mut dtype_errors: Vec<String> = Vec::new();
    let mut used: BTreeSet<String> = BTreeSet::new();
    // Role per layer (usize::MAX for global roles) -> view; per (layer, expert) for experts.
    let mut found: BTreeMap<(usize, Role), WeightTensor> = BTreeMap::new();
    let mut found_experts: BTreeMap<(usize, usize, Role), WeightTensor> = BTreeMap::new();
    // Weight name -> its scale plane, for a stored-quantized checkpoint.
    let mut scales: BTreeMap<String, WeightTensor> = BTreeMap::new();
    // Weight name -> its checked tensors, for a published quantized checkpoint.
    let mut published: BTreeMap<String, crate::published::PublishedMatrix> = BTreeMap::new();

    // Checks one entry (for `layer` and `expert` where its name has them) and returns its
    // view, or records what is wrong.
    let mut check = |spec: &Spec, layer: Option<usize>, expert: Option<usize>| -> Option<WeightTensor> {
        let template = map.name_for(spec.name);
        let mut name = match layer {
            Some(i) => template.replace("{layer}", &i.to_string()),
            None => template,
        };
        if let Some(e) = expert {
            name = name.replace("{expert}", &e.to_string());
        }
        if let Some(q) = config
            .published
            .as_ref()
            .filter(|q| q.quantizes_linear_layers() && spec.role.is_matrix() && spec.cond.holds(config, layer, layout))
        {
            let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            if !q.ignores(&module) {
                // A published quantized matrix: its tensors, as its config and shape imply.
                let expected: Vec<usize> = spec.shape.iter().map(|d| d.value(config, layer)).collect();
                let mut read = Vec::new();
                let bound = crate::published::bind_matrix(q, index, &module, expected[0], expected[1], &mut read);
                used.extend(read);
                match bound {
                    Ok(m) => {
                        // A static scheme's `input_scale` was bound with the matrix; a dynamic
                        // scheme computes its scales at run time, and compressed-tensors then
                        // reads no stored ones either.
                        for extra in ["input_scale", "input_zero_point"] {
                            let n = format!("{module}.{extra}");
                            if index.raw(&n).is_some() {
                                used.insert(n);
                            }
                        }
                        let values = m.values.clone();
                        published.insert(values.name.clone(), m);
                        return Some(values);
                    }
                    Err(crate::published::BindProblem::Missing(n)) => missing.push(n),
                    Err(crate::published::BindProblem::Shape(e)) => shape_errors.push(e),
                    Err(crate::published::BindProblem::DType(e)) => dtype_errors.push(e),
                }
                return None;
            }
        }
        let Some(raw) = index.raw(&name) else {
            if spec.cond.holds(config, layer, layout) {
                missing.push(name);
            }
            return None;
        };
        if !spec.cond.holds(config, layer, layout) {
            // Present but not wanted (e.g. a bias the config turns off): left for `unused`.
            return None;
        }
        used.insert(name.clone());
        let expected: Vec<usize> = spec.shape.iter().map(|d| d.value(config, layer)).collect();
        if let Some(q) = config.quantization.filter(|_| spec.role.is_matrix()) {
            // A stored-quantized matrix: its two planes, with the shapes and dtypes the
            // matrix's shape implies.
            // A `q4_k-packed` checkpoint stores each matrix in Q8_0 (F16 scales) or, with U8
            // scales, in Q6_0 (scales of Q6_0's length), Q4_K (columns whole 256-column
            // super-blocks) or Q5_0 (otherwise), as `kylin quantize --to q4_k` chose; a
            // `q8_0-packed` one only Q8_0.
            let (rows, cols) = (expected[0], expected[1]);
            let why = || spec.shape.iter().map(|d| d.explain(config, layer)).collect::<Vec<_>>().join(", ");
            let scale_name = format!("{name}_scale");
            let byte_scales = index.raw(&scale_name).filter(|r| r.dtype == Some(DType::U8));
            let u8_scales = q == StoredQuantization::KylinQ4K && byte_scales.is_some();
            let scale_cols = byte_scales.and_then(|r| r.shape.get(1).copied()).unwrap_or(0);
            let (format, unit) =
                if u8_scales { (StoredQuantization::byte_scales_format(cols, scale_cols), 64) } else { ("Q8_0", 32) };
            if cols == 0 || !cols.is_multiple_of(unit) {
                shape_errors.push(format!(
                    "tensor '{name}': {format} needs columns in multiples of {unit}; the matrix has {cols} ({})",
                    why()
                ));
                return None;
            }
            let groups = rows.div_ceil(16);
            let planes: [(&String, Vec<usize>, DType); 2] = if u8_scales {
                // Q4_K: a header per super-block and two bytes per sub-block of 16 rows; Q5_0:
                // 96 bytes per sub-block (scales and high bits); Q6_0: 160.
                let scale_bytes = match format {
                    "Q5_0" => 3 * cols,
                    "Q6_0" => 5 * cols,
                    _ => 64 * cols.div_ceil(256) + cols,
                };
                [(&name, vec![groups, cols * 8], DType::U8), (&scale_name, vec![groups, scale_bytes], DType::U8)]
            } else {
                let blocks = cols / 32;
                [(&name, vec![groups, blocks, 512], DType::U8), (&scale_name, vec![groups, blocks, 16], DType::F16)]
            };
            let mut views: [Option<WeightTensor>; 2] = [None, None];
            for (slot, (plane, shape, dtype)) in views.iter_mut().zip(planes) {
                let Some(raw) = index.raw(plane) else {
                    missing.push(plane.clone());
                    return None;
                };
                used.insert(plane.clone());
                if raw.shape != shape {
                    shape_errors.push(format!(
                        "tensor '{plane}' has shape {}; expected {} ({format} planes of a [{rows}, {cols}] matrix: {})",
                        shape_text(&raw.shape),
                        shape_text(&shape),
                        why()
                    ));
                    return None;
                }
                match (raw.dtype, index.view(plane)) {
                    (Some(dt), Some(view)) if dt == dtype => *slot = Some(view),
                    _ => {
                        dtype_errors.push(format!(
                            "tensor '{plane}' is stored as {}; a {format} plane is {}",
                            raw.dtype_name,
                            dtype.as_str()
                        ));
                        return None;
                    }
                }
            }
            // Each plane either filled its slot or returned above.
            let [Some(quants), Some(scale)] = views else { return None };
            scales.insert(name.clone(), scale);
            return Some(quants);
        }
        if raw.shape != expected {
            let why: Vec<String> = spec.shape.iter().map(|d| d.explain(config, layer)).collect();
            shape_errors.push(format!(
                "tensor '{name}' has shape {}; expected {} (from {})",
                shape_text(&raw.shape),
                shape_text(&expected),
                why.join(", ")
            ));
            return None;
        }
        match (raw.dtype, index.view(&name)) {
            (Some(DType::U8), Some(view)) if spec.role.is_packed_bytes() => Some(view),
            (Some(_), Some(_)) if spec.role.is_packed_bytes() => {
                dtype_errors
                    .push(format!("tensor '{name}' is stored as {}; MXFP4 codes and scales are U8", raw.dtype_name));
                None
            }
            (Some(dt), Some(view)) if dt.is_float() => Some(view),
            _ => {
                dtype_errors.push(format!(
                    "tensor '{name}' is stored as {}; the engine computes on BF16, F16 or F32 only",
                    raw.dtype_name
                ));
                None
            }
        }
    };
    let experts = config.decoder.moe.map_or(0, |m| m.num_experts);
    for spec in &specs {
        if !spec.name.contains("{layer}") {
            if let Some(t) = check(spec, None, None) {
                found.insert((usize::MAX, spec.role), t);
            }
            continue;
        }
        for i in 0..config.num_layers {
            if !spec.name.contains("{expert}") {
                if let Some(t) = check(spec, Some(i), None) {
                    found.insert((i, spec.role), t);
                }
            } else if spec.cond.holds(config, Some(i), layout) {
                for e in 0..experts {
                    if let Some(t) = check(spec, Some(i), Some(e)) {
                        found_experts.insert((i, e, spec.role), t);
                    }
                }
            }
        }
    }

    if !missing.is_empty() {
        let mut msg =
            format!("{} required tensors are missing from the checkpoint: {}", missing.len(), missing.join(", "));
        if missing.iter().any(|n| n == &map.name_for("lm_head.weight")) {
            msg.push_str(
                "; tie_word_embeddings is false so the head needs its own lm_head.weight \
                 (if the model shares the embedding, set \"tie_word_embeddings\": true in config.json)",
            );
        } else if map.renames.is_empty() {
            msg.push_str("; if the checkpoint names them differently, pass a tensor map file");
        }
        return Err(KylinError::tensor_missing(msg));
    }
    if !shape_errors.is_empty() {
        return Err(KylinError::tensor_shape_mismatch(shape_errors.join("; ")));
    }
    if !dtype_errors.is_empty() {
        return Err(KylinError::tensor_dtype_unsupported(dtype_errors.join("; ")));
    }

    let lm_head_name = map.name_for("lm_head.weight");
    let embed_tokens = take(&mut found, usize::MAX, Role::Embed)?;
    let final_norm = take(&mut found, usize::MAX, Role::FinalNorm)?;
    let (lm_head, head) = if config.tie_word_embeddings {
        let reason = if index.raw(&lm_head_name).is_some() {
            used.insert(lm_head_name.clone());
            format!(
                "tie_word_embeddings is true; {lm_head_name} is present but ignored, as transformers does: \
                 the head uses the embedding matrix"
            )
        } else {
            "tie_word_embeddings is true: the head uses the embedding matrix".to_string()
        };
        (embed_tokens.clone(), HeadBinding { tied: true, reason })
    } else {
        (
            take(&mut found, usize::MAX, Role::LmHead)?,
            HeadBinding { tied: false, reason: format!("tie_word_embeddings is false: the head is {lm_head_name}") },
        )
    };
    // The family's other global tensors (Gemma 4's per-layer input embedding and projection).
    let globals: BTreeMap<Role, WeightTensor> =
        specs.iter().filter_map(|s| found.remove(&(usize::MAX, s.role)).map(|t| (s.role, t))).collect();
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let mut tensors: BTreeMap<Role, WeightTensor> = BTreeMap::new();
        for spec in specs.iter().filter(|s| s.name.contains("{layer}")) {
            if let Some(t) = found.remove(&(i, spec.role)) {
                tensors.insert(spec.role, t);
            }
        }
        split_fused(config, i, &mut tensors)?;
        let mut per_expert: Vec<BTreeMap<Role, WeightTensor>> = (0..experts).map(|_| BTreeMap::new()).collect();
        // This layer's entries are the map's first ones (keys start with the layer).
        let rest = found_experts.split_off(&(i + 1, 0, Role::Embed));
        for ((_, e, role), t) in std::mem::replace(&mut found_experts, rest) {
            per_expert[e].insert(role, t);
        }
        if config.decoder.layers.get(i).is_some_and(|l| l.ffn.has_experts()) {
            split_stacked(config, i, &mut tensors, &mut per_expert, &mut published)?;
        } else {
            per_expert.clear();
        }
        layers.push(LayerWeights { tensors, experts: per_expert });
    }
    let unused: Vec<String> = index.names().filter(|n| !used.contains(*n)).map(str::to_string).collect();
    Ok(Bound {
        weights: ModelWeights { embed_tokens, final_norm, lm_head, head, globals, layers, scales, published },
        unused,
    })
}
