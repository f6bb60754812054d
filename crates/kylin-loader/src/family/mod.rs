//! The architecture registry: one module per family, one line per family in [`REGISTRY`].
//!
//! A family is everything Kylin knows about one `architectures[0]` value of `config.json`:
//!
//! - its **defaults** ([`Defaults`]): the values transformers' `*Config` class declares for the
//!   fields a `config.json` may leave out;
//! - its **resolver** ([`Family::resolve`]): reads the family's own fields (windows, soft-caps,
//!   multipliers, RoPE per layer type, ...), validates them, and writes the decisions into the
//!   [`ModelConfig`] the shared resolver prepared (`config.rs` reads the fields every family
//!   shares: sizes, heads, the global RoPE, token ids, quantization);
//! - its **tensor table** ([`Family::tensors`]): which checkpoint tensor fills which role, with
//!   which shape, assembled from the shared groups of [`crate::arch`];
//! - its **decoder**, as data ([`DecoderSpec`]): which shared blocks run in which order with
//!   which constants. The engine composes its layers from it; no family has code of its own
//!   in `forward`.
//!
//! Adding a family is one module here (a `Family` constant) and one line in [`REGISTRY`]; the
//! reference tests pick up every family that has a fixture.

use serde::Serialize;

use crate::arch::Spec;
use crate::config::{HfConfig, ModelConfig, RopeConfig};
use crate::error::Result;

pub mod gemma2;
pub mod gemma3;
pub mod gemma4;
pub mod glm4_moe;
pub mod gpt_oss;
pub mod granite;
pub mod lfm2;
pub mod lfm2_moe;
pub mod llama;
pub mod mistral;
pub mod mixtral;
pub mod olmo2;
pub mod olmoe;
pub mod phi3;
pub mod qwen2;
pub mod qwen2_moe;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_moe;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod smollm3;

/// Every family Kylin's native engine runs, by `architectures[0]`.
pub static REGISTRY: &[&Family] = &[
    &qwen3::FAMILY,
    &qwen2::FAMILY,
    &llama::FAMILY,
    &mistral::FAMILY,
    &phi3::FAMILY,
    &gemma2::FAMILY,
    &gemma3::FAMILY,
    &gemma4::FAMILY,
    &smollm3::FAMILY,
    &olmo2::FAMILY,
    &granite::FAMILY,
    &qwen3_moe::FAMILY,
    &qwen2_moe::FAMILY,
    &mixtral::FAMILY,
    &olmoe::FAMILY,
    &gpt_oss::FAMILY,
    &qwen3_5::FAMILY,
    &lfm2::FAMILY,
    &qwen3_5_moe::FAMILY,
    &lfm2_moe::FAMILY,
    &qwen3_next::FAMILY,
    &glm4_moe::FAMILY,
];

/// The defaults transformers' configuration class declares for fields `config.json` may omit.
#[derive(Debug, Clone, Copy)]
pub struct Defaults {
    pub max_position_embeddings: usize,
    /// `None`: `hidden_size / num_attention_heads`.
    pub head_dim: Option<usize>,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    /// `None`: `intermediate_size` is required. `Some(0)`: the family's configuration class has
    /// no such field because no layer has a dense MLP (Qwen3.5-MoE), so a `config.json`
    /// without it is complete.
    pub intermediate_size: Option<usize>,
}

/// The transformers defaults most families share (Llama's).
pub const LLAMA_DEFAULTS: Defaults = Defaults {
    max_position_embeddings: 2048,
    head_dim: None,
    rms_norm_eps: 1e-6,
    rope_theta: 10000.0,
    tie_word_embeddings: false,
    intermediate_size: None,
};

/// One architecture: its names, defaults, resolver and tensor table.
pub struct Family {
    /// The `architectures[0]` value (the Hugging Face class name).
    pub hf_name: &'static str,
    /// The `model_type` transformers writes for it.
    pub model_type: &'static str,
    /// The vision-language class whose language model this family is (`text_config` nested in
    /// `config.json`, weights under `model.language_model.*`), if the family is published so.
    pub multimodal: Option<&'static str>,
    /// What is particular to the family, one line, for `kylin inspect --architectures`.
    pub about: &'static str,
    pub defaults: Defaults,
    /// Reads the family's own fields from `hf` and writes its decisions into `config`, which
    /// arrives with the shared fields resolved and a plain pre-norm SwiGLU decoder
    /// ([`DecoderSpec::plain`]); records defaulted fields in `config.defaulted`.
    pub resolve: fn(hf: &HfConfig, config: &mut ModelConfig) -> Result<()>,
    /// The tensor table, as shared groups.
    pub tensors: &'static [&'static [Spec]],
}

impl Family {
    /// Whether the family stores fused projections (`qkv_proj`, `gate_up_proj`).
    pub fn has_fused_projections(&self) -> bool {
        self.tensors.iter().flat_map(|g| g.iter()).any(|s| s.role.is_fused())
    }
}

impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.hf_name)
    }
}

/// The family registered under `name` (`architectures[0]`). The bare decoder `XModel` (how
/// sentence-transformers saves a decoder embedder such as Qwen3-Embedding: no head) is the
/// family of `XForCausalLM`.
pub fn find(name: &str) -> Option<&'static Family> {
    REGISTRY.iter().copied().find(|f| f.hf_name == name || f.multimodal == Some(name)).or_else(|| {
        let base = name.strip_suffix("Model")?;
        REGISTRY.iter().copied().find(|f| f.hf_name.strip_suffix("ForCausalLM") == Some(base))
    })
}

/// How the decoder's RMSNorms scale: by `w` (Llama) or by `1 + w` (Gemma, whose weights are
/// stored as offsets from one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    Rms,
    RmsUnitOffset,
}

/// Where a sub-block's norms sit: before it (pre-norm), after it before the residual add
/// (post-norm), or both (Gemma's sandwich).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum NormPlacement {
    Pre,
    Post,
    PreAndPost,
}

impl NormPlacement {
    pub fn pre(self) -> bool {
        matches!(self, NormPlacement::Pre | NormPlacement::PreAndPost)
    }

    pub fn post(self) -> bool {
        matches!(self, NormPlacement::Post | NormPlacement::PreAndPost)
    }
}

/// RMSNorm on queries and keys before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    None,
    /// One `(head_dim)` weight applied to every head (Qwen3, Gemma 3).
    PerHead,
    /// One weight over the whole projection, `(num_heads * head_dim)` and
    /// `(num_kv_heads * head_dim)` (OLMo 2).
    Projection,
}

/// The gated MLP's activation: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// `silu` (SwiGLU).
    Silu,
    /// `gelu_pytorch_tanh` (GeGLU with the tanh approximation).
    GeluTanh,
}

impl Activation {
    /// The activation named by `hidden_act` / `hidden_activation`.
    pub fn from_hf(name: &str) -> Option<Activation> {
        match name {
            "silu" | "swish" => Some(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" => Some(Activation::GeluTanh),
            _ => None,
        }
    }
}

/// Which rotary table a layer's attention uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerRope {
    /// `ModelConfig::rope` (the global one).
    Global,
    /// `DecoderSpec::local_rope` (Gemma 3's sliding layers).
    Local,
    /// No rotary embedding at all (SmolLM3's NoPE layers).
    None,
}

/// What mixes information across positions in a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MixerKind {
    /// Self-attention (full or sliding) over the KV cache.
    Attention,
    /// Gated DeltaNet linear attention (Qwen3.5's `linear_attn`): a causal convolution, then
    /// the gated delta rule over a fixed-size state per sequence ([`LinearAttention`]).
    GatedDeltaNet,
    /// LFM2's short convolution (`conv`): `out_proj(C · conv(B · x))` with a rolling state of
    /// the last `kernel - 1` inputs per sequence ([`ShortConv`]).
    ShortConv,
}

impl MixerKind {
    /// Whether the mixer keeps a fixed-size state per sequence instead of keys and values.
    pub fn is_recurrent(self) -> bool {
        matches!(self, MixerKind::GatedDeltaNet | MixerKind::ShortConv)
    }
}

/// The sizes of the Gated DeltaNet layers (Qwen3.5's `linear_*` fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LinearAttention {
    /// `linear_num_key_heads`: query and key heads (each serves `value_heads / key_heads`
    /// consecutive value heads).
    pub key_heads: usize,
    /// `linear_num_value_heads`.
    pub value_heads: usize,
    /// `linear_key_head_dim`.
    pub key_head_dim: usize,
    /// `linear_value_head_dim`.
    pub value_head_dim: usize,
    /// `linear_conv_kernel_dim`: taps of the causal convolution over q, k and v.
    pub conv_kernel: usize,
    /// The input projections are Qwen3-Next's fused `in_proj_qkvz` and `in_proj_ba`, their rows
    /// grouped per key head, rather than Qwen3.5's four matrices.
    pub grouped_projections: bool,
}

impl LinearAttention {
    /// `key_heads · key_head_dim`.
    pub fn key_dim(&self) -> usize {
        self.key_heads * self.key_head_dim
    }

    /// `value_heads · value_head_dim`.
    pub fn value_dim(&self) -> usize {
        self.value_heads * self.value_head_dim
    }

    /// Channels of the convolution: queries, keys and values, `2 · key_dim + value_dim`.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
}

/// LFM2's short-convolution layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ShortConv {
    /// `conv_L_cache`: taps of the depthwise convolution.
    pub kernel: usize,
    /// `conv_bias`: the projections and the convolution carry biases.
    pub bias: bool,
}

/// A layer's feed-forward block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FfnKind {
    /// The gated MLP.
    Dense,
    /// Routed experts ([`MoeSpec`]), with a shared expert where the family has one.
    Moe,
    /// The gated MLP and routed experts side by side, their outputs normed and summed
    /// (Gemma 4's `enable_moe_block`).
    DenseAndMoe,
}

impl FfnKind {
    /// Whether the block has the gated MLP.
    pub fn has_mlp(self) -> bool {
        matches!(self, FfnKind::Dense | FfnKind::DenseAndMoe)
    }

    /// Whether the block has routed experts.
    pub fn has_experts(self) -> bool {
        matches!(self, FfnKind::Moe | FfnKind::DenseAndMoe)
    }
}

/// How a Mixture-of-Experts router turns its logits into each token's experts and weights.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// Softmax over every expert, the top k, renormalised to sum to one when `normalize`
    /// (Qwen3-MoE's and OLMoE's `norm_topk_prob`; always in Mixtral).
    SoftmaxTopK { normalize: bool },
    /// The top k of the logits, then a softmax over those k (gpt-oss).
    TopKSoftmax,
    /// Gemma 4: the router's input is RMS-normed (no weight), scaled by the stored `scale`
    /// vector and `hidden^-0.5`; softmax, top k, renormalised, each weight times its expert's
    /// stored `per_expert_scale`.
    Gemma4,
    /// LFM2-MoE and GLM-4.5 (DeepSeek-V3's router): `sigmoid` of each logit; the top k chosen
    /// by `sigmoid + bias` when `selection_bias` (LFM2's `expert_bias`, GLM's
    /// `e_score_correction_bias`: the stored bias only selects, it never weighs), by the
    /// sigmoids otherwise, among the experts of the `kept_groups` best of `groups` equal
    /// groups (a group's score: the sum of its two best choice values; GLM's `n_group`,
    /// `topk_group`; one group keeps every expert); weighted by the sigmoids alone,
    /// `w / (Σ w + normalize_epsilon)` when `normalize` (LFM2 1e-6, GLM 1e-20), every weight
    /// times `scale` (`routed_scaling_factor`).
    SigmoidTopK {
        normalize: bool,
        selection_bias: bool,
        scale: f64,
        groups: usize,
        kept_groups: usize,
        normalize_epsilon: f64,
    },
}

/// The most expert groups [`Routing::SigmoidTopK`] keeps apart (DeepSeek-V3 has 8; the router
/// marks the kept groups in a fixed array, so nothing is allocated per token).
pub const MAX_EXPERT_GROUPS: usize = 64;

/// The experts' activation: `down(act(gate) · up)`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertActivation {
    Silu,
    GeluTanh,
    /// gpt-oss: `gate = min(gate, limit)`, `up = clamp(up, -limit, limit)`,
    /// `(up + 1) · gate · sigmoid(alpha · gate)`; gate and up interleaved in a fused
    /// `gate_up_proj` (even rows gate, odd rows up).
    ClampedSwiGlu {
        alpha: f64,
        limit: f64,
    },
}

/// A model's Mixture-of-Experts block (the same on every layer that has one).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct MoeSpec {
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// One expert's width.
    pub intermediate: usize,
    pub routing: Routing,
    pub activation: ExpertActivation,
    /// The router and the experts' projections carry biases (gpt-oss).
    pub router_bias: bool,
    pub expert_bias: bool,
    /// A shared expert of this width beside the routed ones (Qwen2-MoE, GLM-4.5).
    pub shared_intermediate: Option<usize>,
    /// The shared expert's output is times `sigmoid(shared_expert_gate(x))` (Qwen2-MoE,
    /// Qwen3.5-MoE, Qwen3-Next); GLM-4.5's is added as it is.
    pub shared_gated: bool,
}

/// One decoder layer's choices and sizes (the model-wide values unless the family varies
/// them per layer, as Gemma 4 does).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct LayerSpec {
    pub mixer: MixerKind,
    pub ffn: FfnKind,
    /// A sliding window of this many positions (the query's own included), or full attention.
    pub window: Option<usize>,
    pub rope: LayerRope,
    /// The width of each attention head (Gemma 4's global layers: 512 beside 256).
    pub head_dim: usize,
    pub num_kv_heads: usize,
    /// The MLP's width (Gemma 4's double-wide MLP on its KV-sharing layers).
    pub intermediate: usize,
    /// The layer attends over the keys and values this earlier layer stored, and computes none
    /// of its own (Gemma 4's `num_kv_shared_layers`).
    pub kv_source: Option<usize>,
    /// The values are the key projection's output (before its norm and RoPE): the layer has
    /// no `v_proj` (Gemma 4's `attention_k_eq_v`, on full-attention layers).
    pub value_is_key: bool,
}

impl LayerSpec {
    /// Whether the layer projects its own keys (and values): it does not share another's.
    pub fn has_kv_projections(&self) -> bool {
        self.kv_source.is_none()
    }

    /// Whether the layer has a `v_proj` of its own.
    pub fn has_value_projection(&self) -> bool {
        self.kv_source.is_none() && !self.value_is_key
    }
}

/// The decoder as data: which shared blocks, in which order, with which constants. Every
/// value is decided by the family's resolver; the engine never looks at the family's name.
///
/// A layer runs, with `r` the residual scale:
/// 1. attention: `h = norm?(x)`, q/k/v projections, q/k norm, RoPE (per the layer), attention
///    (window, scale, soft-cap), `o_proj`, `h = post_norm?(h)`, `x = x + r · h`;
/// 2. MLP: `h = norm?(x)`, `down(act(gate(h)) * up(h))`, `h = post_norm?(h)`, `x = x + r · h`.
///
/// Around the layers: `x = embed(ids) · embedding_scale`, then the final norm, the head,
/// `logits / logits_divisor`, and the final soft-cap.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecoderSpec {
    pub norm: NormKind,
    pub attention_norms: NormPlacement,
    pub mlp_norms: NormPlacement,
    pub qk_norm: QkNorm,
    pub activation: Activation,
    /// Multiplies the embedding rows (Gemma: `√hidden_size`; Granite: `embedding_multiplier`).
    pub embedding_scale: f64,
    /// Multiplies each sub-block's output before the residual add (Granite's
    /// `residual_multiplier`).
    pub residual_scale: f64,
    /// The attention score scale (`head_dim^-0.5`; Gemma: `query_pre_attn_scalar^-0.5`;
    /// Granite: `attention_multiplier`).
    pub attention_scale: f64,
    /// `s = cap · tanh(s / cap)` on attention scores (Gemma 2).
    pub attention_softcap: Option<f64>,
    /// The same on the final logits (Gemma 2).
    pub final_softcap: Option<f64>,
    /// Logits are divided by this (Granite's `logits_scaling`).
    pub logits_divisor: f64,
    /// Per layer: window, rotary table, sizes and KV source.
    pub layers: Vec<LayerSpec>,
    /// The rotary table of [`LayerRope::Local`] layers.
    pub local_rope: Option<RopeConfig>,
    /// RMSNorm without a weight on each value head (Gemma 4's `v_norm`).
    pub value_norm: bool,
    /// Per-layer input embeddings (Gemma 4's `hidden_size_per_layer_input`): each layer gets
    /// a vector of this width per token, from a second embedding and a projection of the
    /// first, and adds a gated projection of it to the residual stream after its MLP.
    pub per_layer_input: Option<PerLayerInput>,
    /// Each layer's output is multiplied by its stored `layer_scalar` (Gemma 4).
    pub layer_scalar: bool,
    /// The routed experts of the layers whose `ffn` has them.
    pub moe: Option<MoeSpec>,
    /// Attention sinks: a learned logit per query head that joins every softmax's
    /// denominator (gpt-oss's `sinks`).
    pub attention_sinks: bool,
    /// Attention's output is gated per element: `q_proj` gives each head its queries and then
    /// as many gate values, and `o_proj` reads `attention · sigmoid(gate)` (Qwen3.5).
    pub attention_output_gate: bool,
    /// The sizes of the [`MixerKind::GatedDeltaNet`] layers, when the model has any.
    pub linear_attention: Option<LinearAttention>,
    /// The sizes of the [`MixerKind::ShortConv`] layers, when the model has any.
    pub short_conv: Option<ShortConv>,
}

/// The sizes of Gemma 4's per-layer inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PerLayerInput {
    /// `hidden_size_per_layer_input`: one layer's share of a token's vector.
    pub width: usize,
    /// `vocab_size_per_layer_input`: rows of `embed_tokens_per_layer`.
    pub vocab: usize,
    /// The row an image's tokens read: the text model's `pad_token_id`, as transformers'
    /// `Gemma4Model` replaces multimodal ids by it (0 when the field is absent, its default).
    pub pad_row: usize,
}

impl DecoderSpec {
    /// Llama's decoder: pre-norm RMSNorm, SwiGLU, full attention with the global RoPE on
    /// every layer, no multipliers; every layer of the same sizes.
    pub fn plain(num_layers: usize, head_dim: usize, num_kv_heads: usize, intermediate: usize) -> DecoderSpec {
        let layer = LayerSpec {
            mixer: MixerKind::Attention,
            ffn: FfnKind::Dense,
            window: None,
            rope: LayerRope::Global,
            head_dim,
            num_kv_heads,
            intermediate,
            kv_source: None,
            value_is_key: false,
        };
        DecoderSpec {
            norm: NormKind::Rms,
            attention_norms: NormPlacement::Pre,
            mlp_norms: NormPlacement::Pre,
            qk_norm: QkNorm::None,
            activation: Activation::Silu,
            embedding_scale: 1.0,
            residual_scale: 1.0,
            attention_scale: (head_dim as f64).powf(-0.5),
            attention_softcap: None,
            final_softcap: None,
            logits_divisor: 1.0,
            layers: vec![layer; num_layers],
            local_rope: None,
            value_norm: false,
            per_layer_input: None,
            layer_scalar: false,
            moe: None,
            attention_sinks: false,
            attention_output_gate: false,
            linear_attention: None,
            short_conv: None,
        }
    }

    /// A short description for `inspect`: `sliding window 4096 on 20 of 26 layers`, ...
    pub fn describe(&self) -> Vec<String> {
        let mut out = Vec::new();
        let count = |kind: MixerKind| self.layers.iter().filter(|l| l.mixer == kind).count();
        if let Some(l) = &self.linear_attention {
            out.push(format!(
                "Gated DeltaNet on {} of {} layers ({} key heads x {}, {} value heads x {}, conv {})",
                count(MixerKind::GatedDeltaNet),
                self.layers.len(),
                l.key_heads,
                l.key_head_dim,
                l.value_heads,
                l.value_head_dim,
                l.conv_kernel
            ));
        }
        if let Some(c) = &self.short_conv {
            out.push(format!(
                "short convolution on {} of {} layers (kernel {})",
                count(MixerKind::ShortConv),
                self.layers.len(),
                c.kernel
            ));
        }
        if self.attention_output_gate {
            out.push("gated attention output".into());
        }
        let sliding: Vec<usize> = self.layers.iter().filter_map(|l| l.window).collect();
        if let Some(&w) = sliding.first() {
            out.push(format!("sliding window {w} on {} of {} layers", sliding.len(), self.layers.len()));
        }
        let nope = self.layers.iter().filter(|l| l.rope == LayerRope::None).count();
        if nope > 0 {
            out.push(format!("no RoPE on {nope} of {} layers", self.layers.len()));
        }
        if let Some(local) = &self.local_rope {
            out.push(format!("local RoPE base {}", local.theta));
        }
        let first = self.layers.first();
        let mut head_dims: Vec<usize> = self.layers.iter().map(|l| l.head_dim).collect();
        head_dims.sort_unstable();
        head_dims.dedup();
        if head_dims.len() > 1 {
            let per_layer: Vec<String> = self.layers.iter().map(|l| l.head_dim.to_string()).collect();
            out.push(format!("head_dim per layer {}", per_layer.join(",")));
        }
        if self.layers.iter().any(|l| Some(l.num_kv_heads) != first.map(|f| f.num_kv_heads)) {
            let per_layer: Vec<String> = self.layers.iter().map(|l| l.num_kv_heads.to_string()).collect();
            out.push(format!("KV heads per layer {}", per_layer.join(",")));
        }
        let shared = self.layers.iter().filter(|l| l.kv_source.is_some()).count();
        if shared > 0 {
            out.push(format!("{shared} layers reuse earlier layers' keys and values"));
        }
        let k_eq_v = self.layers.iter().filter(|l| l.value_is_key && l.kv_source.is_none()).count();
        if k_eq_v > 0 {
            out.push(format!("values are the keys' projection on {k_eq_v} layers"));
        }
        if self.layers.iter().any(|l| Some(l.intermediate) != first.map(|f| f.intermediate)) {
            let per_layer: Vec<String> = self.layers.iter().map(|l| l.intermediate.to_string()).collect();
            out.push(format!("MLP width per layer {}", per_layer.join(",")));
        }
        if self.value_norm {
            out.push("value norm".into());
        }
        if let Some(p) = self.per_layer_input {
            out.push(format!("per-layer inputs of {} per layer", p.width));
        }
        if self.layer_scalar {
            out.push("layer scalars".into());
        }
        if let Some(m) = &self.moe {
            let layers = self.layers.iter().filter(|l| l.ffn.has_experts()).count();
            let mut text = format!(
                "{} experts of width {}, top {}, on {layers} of {} layers",
                m.num_experts,
                m.intermediate,
                m.top_k,
                self.layers.len()
            );
            if let Some(w) = m.shared_intermediate {
                text.push_str(&format!(", shared expert of width {w}"));
            }
            if self.layers.iter().any(|l| l.ffn == FfnKind::DenseAndMoe) {
                text.push_str(", beside the dense MLP");
            }
            out.push(text);
        }
        if self.attention_sinks {
            out.push("attention sinks".into());
        }
        if self.norm == NormKind::RmsUnitOffset {
            out.push("norms scale by (1 + w)".into());
        }
        match (self.attention_norms, self.mlp_norms) {
            (NormPlacement::Pre, NormPlacement::Pre) => {}
            (NormPlacement::Post, NormPlacement::Post) => out.push("post-norms".into()),
            _ => out.push("pre- and post-norms".into()),
        }
        match self.qk_norm {
            QkNorm::None => {}
            QkNorm::PerHead => out.push("q/k norm per head".into()),
            QkNorm::Projection => out.push("q/k norm over the projection".into()),
        }
        if self.activation == Activation::GeluTanh {
            out.push("GeGLU (gelu tanh)".into());
        }
        if let Some(c) = self.attention_softcap {
            out.push(format!("attention soft-cap {c}"));
        }
        if let Some(c) = self.final_softcap {
            out.push(format!("final soft-cap {c}"));
        }
        if self.embedding_scale != 1.0 {
            out.push(format!("embedding x{}", self.embedding_scale));
        }
        if self.residual_scale != 1.0 {
            out.push(format!("residual x{}", self.residual_scale));
        }
        if self.logits_divisor != 1.0 {
            out.push(format!("logits /{}", self.logits_divisor));
        }
        out
    }
}

/// `CONFIG_INVALID` unless `layer_types` has one entry per layer.
fn check_layer_types_len(types: &[String], num_layers: usize) -> Result<()> {
    if types.len() != num_layers {
        return Err(crate::error::KylinError::config_invalid(format!(
            "config.json layer_types has {} entries; num_hidden_layers is {num_layers}",
            types.len()
        )));
    }
    Ok(())
}

/// A hybrid family's mixers from `layer_types`: `full_attention` is attention, `recurrent` (the
/// family's name for its other layer, `linear_attention` or `conv`) is `kind`; anything else, or
/// a list of the wrong length, is refused naming the entry.
pub(crate) fn mixers_from_layer_types(
    types: &[String],
    num_layers: usize,
    family: &str,
    recurrent: &str,
    kind: MixerKind,
) -> Result<Vec<MixerKind>> {
    use crate::error::KylinError;
    check_layer_types_len(types, num_layers)?;
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "full_attention" => Ok(MixerKind::Attention),
            r if r == recurrent => Ok(kind),
            other => Err(KylinError::operator_unsupported(format!(
                "config.json layer_types[{i}] is '{other}'; {family}'s layers are '{recurrent}' or 'full_attention'"
            ))),
        })
        .collect()
}

/// The sliding window of each layer from `layer_types` (`sliding_attention` /
/// `full_attention`), as transformers 5 writes it; `CONFIG_INVALID` for another length or
/// value, `OPERATOR_UNSUPPORTED` for a layer type Kylin does not run.
pub(crate) fn windows_from_layer_types(
    types: &[String],
    num_layers: usize,
    window: Option<usize>,
) -> Result<Vec<Option<usize>>> {
    use crate::error::KylinError;
    check_layer_types_len(types, num_layers)?;
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "full_attention" => Ok(None),
            "sliding_attention" => match window {
                Some(w) => Ok(Some(w)),
                None => Err(KylinError::config_invalid(format!(
                    "config.json layer_types[{i}] is 'sliding_attention' but sliding_window is null"
                ))),
            },
            other => Err(KylinError::operator_unsupported(format!(
                "config.json layer_types[{i}] is '{other}'; Kylin runs 'full_attention' and 'sliding_attention' layers"
            ))),
        })
        .collect()
}

/// A positive window size from `sliding_window` (`None` when absent or null).
pub(crate) fn sliding_window(hf: &HfConfig) -> Result<Option<usize>> {
    match hf.sliding_window {
        None => Ok(None),
        Some(0) => Err(crate::error::KylinError::config_invalid(
            "config.json field 'sliding_window' is 0; it must be positive or null",
        )),
        Some(w) => Ok(Some(usize::try_from(w.min(u32::MAX as u64)).unwrap_or(u32::MAX as usize))),
    }
}

/// The activation named by `hidden_act` (or `key`), defaulting to `default`; `CONFIG_INVALID`
/// naming the field for one Kylin does not implement.
pub(crate) fn activation(hf: &HfConfig, key: &str, default: Activation, config: &mut ModelConfig) -> Result<()> {
    let name = match crate::config::raw_str(hf, key)? {
        Some(n) => n,
        None => {
            config.defaulted.push(key.to_string());
            config.hidden_act = match default {
                Activation::Silu => "silu".into(),
                Activation::GeluTanh => "gelu_pytorch_tanh".into(),
            };
            config.decoder.activation = default;
            return Ok(());
        }
    };
    let act = Activation::from_hf(&name).ok_or_else(|| {
        crate::error::KylinError::config_invalid(format!(
            "config.json field '{key}' is '{name}'; Kylin's {} block supports 'silu' and 'gelu_pytorch_tanh'",
            config.architecture.hf_name()
        ))
    })?;
    config.hidden_act = name;
    config.decoder.activation = act;
    Ok(())
}

/// Every layer slides by `window` (Mistral, Phi-3), or none does.
pub(crate) fn every_layer_slides(config: &mut ModelConfig, window: Option<usize>) {
    // A window as long as the context never cuts anything: full attention, stated plainly.
    let window = window.filter(|&w| w < config.max_position_embeddings);
    for layer in &mut config.decoder.layers {
        layer.window = window;
    }
}

/// A number field whose absence means `default` and whose `null` means "none" (Gemma's
/// soft-caps: `attn_logit_softcapping: null` turns capping off); a non-positive value is
/// `CONFIG_INVALID`.
pub(crate) fn nullable_positive(
    hf: &HfConfig,
    key: &str,
    default: Option<f64>,
    config: &mut ModelConfig,
) -> Result<Option<f64>> {
    if !hf.raw.contains_key(key) {
        config.defaulted.push(key.to_string());
        return Ok(default);
    }
    match crate::config::raw_f64(hf, key)? {
        None => Ok(None),
        Some(v) if v > 0.0 => Ok(Some(v)),
        Some(v) => Err(crate::error::KylinError::config_invalid(format!(
            "config.json field '{key}' is {v}; it must be positive or null"
        ))),
    }
}

/// Gemma's shared choices: `(1 + w)` norms before and after each sub-block, GeGLU, the
/// embedding scaled by `√hidden_size` (as an f32, as transformers keeps it), queries scaled
/// by `query_pre_attn_scalar^-0.5`, biases per `attention_bias`.
pub(crate) fn gemma_block(hf: &HfConfig, config: &mut ModelConfig) -> Result<()> {
    let key = if hf.raw.contains_key("hidden_activation") { "hidden_activation" } else { "hidden_act" };
    activation(hf, key, Activation::GeluTanh, config)?;
    hf.attention_bias_or_default(config);
    let d = &mut config.decoder;
    d.norm = NormKind::RmsUnitOffset;
    d.attention_norms = NormPlacement::PreAndPost;
    d.mlp_norms = NormPlacement::PreAndPost;
    d.embedding_scale = (config.hidden_size as f64).sqrt() as f32 as f64;
    let scalar = match crate::config::raw_f64(hf, "query_pre_attn_scalar")? {
        Some(v) if v > 0.0 => v,
        Some(v) => {
            return Err(crate::error::KylinError::config_invalid(format!(
                "config.json field 'query_pre_attn_scalar' is {v}; it must be positive"
            )));
        }
        None => {
            config.defaulted.push("query_pre_attn_scalar".into());
            256.0
        }
    };
    config.decoder.attention_scale = scalar.powf(-0.5);
    Ok(())
}

/// Gemma's sliding layers: `layer_types` when written, else every layer but each
/// `pattern`-th slides (`(i + 1) % pattern != 0`); the window defaults to 4096.
pub(crate) fn gemma_layers(hf: &HfConfig, config: &mut ModelConfig, pattern: usize) -> Result<()> {
    let window = if hf.sliding_window_present { sliding_window(hf)? } else { Some(4096) };
    let n = config.num_layers;
    let windows = match &hf.layer_types {
        Some(types) => windows_from_layer_types(types, n, window)?,
        None => (0..n).map(|i| if (i + 1) % pattern.max(1) != 0 { window } else { None }).collect(),
    };
    for (layer, w) in config.decoder.layers.iter_mut().zip(windows) {
        layer.window = w;
    }
    Ok(())
}

/// What a family's configuration class declares for its Mixture-of-Experts fields.
pub(crate) struct MoeDefaults {
    pub num_experts: usize,
    pub top_k: usize,
    /// The field holding one expert's width (`moe_intermediate_size`, or Mixtral's and
    /// OLMoE's `intermediate_size`) and its default.
    pub width_key: &'static str,
    pub width: usize,
    /// `norm_topk_prob`'s default, or `None` where the family always renormalises (Mixtral).
    pub normalize: Option<bool>,
}

/// The largest expert count a configuration may ask for (the plan is sized by it).
const MAX_EXPERTS: u64 = 4096;

/// The routed experts' common fields: `num_experts` (or `num_local_experts`),
/// `num_experts_per_tok`, the expert width and `norm_topk_prob`, each with the family's
/// default; `CONFIG_INVALID` naming the field for zero or impossible values.
pub(crate) fn moe_fields(hf: &HfConfig, c: &mut ModelConfig, d: &MoeDefaults) -> Result<MoeSpec> {
    use crate::config::{raw_bool, raw_u64};
    use crate::error::KylinError;
    let number = |keys: &[&str], default: usize, c: &mut ModelConfig| -> Result<usize> {
        for key in keys {
            if let Some(v) = raw_u64(hf, key)? {
                if v == 0 || v > MAX_EXPERTS * 1024 {
                    return Err(KylinError::config_invalid(format!(
                        "config.json field '{key}' is {v}; it must be positive (and plausible)"
                    )));
                }
                return Ok(v as usize);
            }
        }
        c.defaulted.push(keys[0].to_string());
        Ok(default)
    };
    let num_experts = number(&["num_experts", "num_local_experts", "n_routed_experts"], d.num_experts, c)?;
    if num_experts as u64 > MAX_EXPERTS {
        return Err(KylinError::config_invalid(format!(
            "config.json field 'num_experts' is {num_experts}; Kylin runs at most {MAX_EXPERTS} experts"
        )));
    }
    let top_k = number(&["num_experts_per_tok", "top_k_experts"], d.top_k, c)?;
    if top_k > num_experts {
        return Err(KylinError::config_invalid(format!(
            "config.json: num_experts_per_tok={top_k} exceeds the {num_experts} experts"
        )));
    }
    let intermediate = number(&[d.width_key], d.width, c)?;
    let normalize = match d.normalize {
        None => true,
        Some(default) => raw_bool(hf, "norm_topk_prob")?.unwrap_or_else(|| {
            c.defaulted.push("norm_topk_prob".into());
            default
        }),
    };
    Ok(MoeSpec {
        num_experts,
        top_k,
        intermediate,
        routing: Routing::SoftmaxTopK { normalize },
        activation: ExpertActivation::Silu,
        router_bias: false,
        expert_bias: false,
        shared_intermediate: None,
        shared_gated: true,
    })
}

/// `shared_expert_intermediate_size`, the width of the shared expert beside the routed ones
/// (Qwen2-MoE, Qwen3.5-MoE), with the family's default; 0 is refused naming the field.
pub(crate) fn shared_expert_width(hf: &HfConfig, c: &mut ModelConfig, family: &str, default: usize) -> Result<usize> {
    use crate::config::raw_u64;
    use crate::error::KylinError;
    match raw_u64(hf, "shared_expert_intermediate_size")? {
        Some(0) => Err(KylinError::config_invalid(format!(
            "config.json field 'shared_expert_intermediate_size' is 0; {family}'s shared expert needs a width"
        ))),
        Some(v) => Ok(v as usize),
        None => {
            c.defaulted.push("shared_expert_intermediate_size".into());
            Ok(default)
        }
    }
}

/// Sets `partial_rotary_factor` to the family's `default` when neither the RoPE parameters nor
/// the top level of `config.json` give it (transformers 5's default for Qwen3.5, 0.25, and
/// GLM-4.5, 0.5), recording it as defaulted.
pub(crate) fn default_partial_rotary(hf: &HfConfig, c: &mut ModelConfig, default: f64) {
    let in_rope =
        hf.rope_parameters.as_ref().is_some_and(|p| p.get("partial_rotary_factor").is_some_and(|v| !v.is_null()));
    if !in_rope && hf.partial_rotary_factor.is_none() {
        c.defaulted.push("partial_rotary_factor".into());
        c.rope.partial_rotary_factor = default;
    }
}

/// `routed_scaling_factor` (LFM2-MoE, GLM-4.5): positive, 1 when absent.
pub(crate) fn routed_scaling_factor(hf: &HfConfig, c: &mut ModelConfig) -> Result<f64> {
    use crate::error::KylinError;
    match crate::config::raw_f64(hf, "routed_scaling_factor")? {
        Some(s) if s.is_finite() && s > 0.0 => Ok(s),
        Some(s) => Err(KylinError::config_invalid(format!(
            "config.json field 'routed_scaling_factor' is {s}; it must be positive"
        ))),
        None => {
            c.defaulted.push("routed_scaling_factor".into());
            Ok(1.0)
        }
    }
}

/// The first `key` layers (LFM2-MoE's `num_dense_layers`, GLM-4.5's `first_k_dense_replace`;
/// `default` when absent) keep the dense MLP, the others get the experts.
pub(crate) fn dense_first_layers(hf: &HfConfig, c: &mut ModelConfig, key: &str, default: usize) -> Result<()> {
    use crate::error::KylinError;
    let n = c.num_layers;
    let dense = match crate::config::raw_u64(hf, key)? {
        Some(d) if d as usize <= n => d as usize,
        Some(d) => {
            return Err(KylinError::config_invalid(format!(
                "config.json field '{key}' is {d}; num_hidden_layers is {n}"
            )));
        }
        None => {
            c.defaulted.push(key.to_string());
            default.min(n)
        }
    };
    for (i, layer) in c.decoder.layers.iter_mut().enumerate() {
        layer.ffn = if i < dense { FfnKind::Dense } else { FfnKind::Moe };
    }
    Ok(())
}

/// Qwen's rule for which layers are sparse: layer `i` has experts unless it is in
/// `mlp_only_layers`, when `(i + 1) % decoder_sparse_step == 0`; the others keep the dense
/// MLP of `intermediate_size`.
pub(crate) fn qwen_sparse_layers(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    use crate::config::{raw_u64, raw_u64_list};
    use crate::error::KylinError;
    let step = raw_u64(hf, "decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(KylinError::config_invalid("config.json field 'decoder_sparse_step' is 0; it must be at least 1"));
    }
    let dense: Vec<u64> = raw_u64_list(hf, "mlp_only_layers")?.unwrap_or_default();
    for (i, layer) in c.decoder.layers.iter_mut().enumerate() {
        let sparse = !dense.contains(&(i as u64)) && (i as u64 + 1).is_multiple_of(step);
        layer.ffn = if sparse { FfnKind::Moe } else { FfnKind::Dense };
    }
    Ok(())
}
