//! The decoder-only transformer every registered family runs on (`kylin_loader::family`).
//!
//! One layer is composed from shared blocks as the family's `DecoderSpec` says: attention with
//! grouped KV heads (a sliding window per layer, a score scale, a soft cap), rotate-half RoPE
//! from the layer's table (global, local, partial, or none), q/k RMSNorm per head or over the
//! projection, norms before and/or after each sub-block (`w` or Gemma's `1 + w`), a gated MLP
//! (SwiGLU or GeGLU), and scalar multipliers on the embedding, the residual branches and the
//! logits, plus a final soft cap. Every choice is made once in [`Model::new`]; `forward` reads
//! as the same numbered steps for every family and never looks at its name.
//!
//! Guarantees:
//! - Weights are read in place, in their stored dtype (BF16, F16 or F32); nothing is copied,
//!   except under [`Model::quantize`] (`--quantize q8_0`), which makes Q8_0 copies of the
//!   linear layers and the head at load, and [`Model::prepare_published`], which decodes a
//!   published quantized checkpoint (compressed-tensors, FP8, GPTQ, AWQ) into f32 weights or
//!   the integer kernels' planes: explicit, reported exceptions.
//! - Every shape is checked in [`Model::new`]; the forward pass never re-checks or branches on a
//!   format.
//! - Activations ([`Scratch`]) are planned by [`Model::plan_scratch`] from the configuration and
//!   the batch limits; the KV cache is the engine's paged [`KvPool`]; [`Model::forward`] allocates
//!   nothing.
//! - A forward pass runs a [`BatchPlan`]: segments of many sequences, each at its own positions.
//!   Linear layers run once over all tokens; norms and RoPE per token; attention per sequence
//!   over its own blocks. A token's result does not depend on the other segments (batch
//!   invariance), as long as the kernels reduce in the same order for any token count.
//! - Compute is float32 in the same order of operations as transformers' eager float32 path,
//!   except under `Precision::Bf16` ([`PrecisionChoice`]), where the inputs of the matrix
//!   products are rounded to BF16 (products and sums stay f32), as transformers computes a
//!   BF16 model's linear layers.

/// The arithmetic of the matrix products, as asked for (`--precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrecisionChoice {
    /// f32 activations: exact match with transformers' float32 references.
    #[default]
    F32,
    /// BF16 activations at every matrix product; needs BF16 weights and a BF16 kernel family,
    /// or Q8_0 weights (`--quantize q8_0`) and AVX-512 BF16 (`kylin_kernels::w16`).
    Bf16,
    /// `bf16` when the weights are BF16 and the CPU has a BF16 kernel family, else `f32`.
    Auto,
    /// int8 activations for every quantized matrix: `--quantize`'s own arithmetic, and for a
    /// published checkpoint the int8 products even where the CPU has the BF16 (`_a16`) ones
    /// (`q4_g` for W4A16/GPTQ/AWQ, `q8_0` for W8A16, FP8 re-quantized to Q8_0): faster where
    /// `vdpbf16ps` is slow (Intel: AMX-INT8 prefill, decode at the memory limit), a little
    /// less accurate (BENCHMARKS.md). `CONFIG_INVALID` for a model without quantized weights.
    Int8,
}

impl PrecisionChoice {
    /// Parses `f32`, `bf16`, `auto` or `int8`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Some(PrecisionChoice::F32),
            "bf16" => Some(PrecisionChoice::Bf16),
            "auto" => Some(PrecisionChoice::Auto),
            "int8" => Some(PrecisionChoice::Int8),
            _ => None,
        }
    }
}

/// A weight format the linear layers can be quantized to at load (`--quantize`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantFormat {
    /// GGUF's Q8_0: blocks of 32 int8 with an f16 scale, int8 activations (`kylin_kernels::quant`).
    Q8_0,
    /// GGUF's Q4_K (super-blocks of 256 with 6-bit sub-block scales and mins; int8 activations,
    /// `kylin_kernels::q4k`), mixed as llama.cpp's Q4_K_M: see [`Model::quantize`].
    Q4K,
    /// A published quantized checkpoint (compressed-tensors, FP8, GPTQ, AWQ) repacked at load
    /// for the integer kernels ([`Model::prepare_published`]): `Q8_0` for 8-bit integers and
    /// FP8, `Q4G` for 4-bit groups. Not a `--quantize` value.
    Published(Packing),
}

impl QuantFormat {
    /// The name used by flags and reports (`q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Published(packing) => packing.name(),
        }
    }

    /// Parses `q8_0`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "q8_0" => Some(QuantFormat::Q8_0),
            "q4_k" => Some(QuantFormat::Q4K),
            _ => None,
        }
    }
}

mod attention;
mod delta_net;
mod input_quant;
mod linear;
mod mlp;
mod moe;
mod mtp;
mod per_layer;
mod scratch;
mod short_conv;

use std::sync::Arc;

use kylin_kernels::paged::{MAX_HEAD_DIM, PARTITION, PartialStats};
use kylin_kernels::quant::{Packing, QuantBuffer, QuantMatrix};
use kylin_kernels::{self as kernels, Bf16Kernels, Precision, ThreadPool, WeightDType};
use kylin_loader::arch::Role;
use kylin_loader::family::{FfnKind, LayerRope, MixerKind};
use kylin_loader::{KylinError, LayerWeights, ModelConfig, ModelWeights, Result, RopeConfig};

use crate::kv_pool::{KvPool, KvShape};
use crate::rope::Ropes;
use crate::shared_mut::SharedMut;
use crate::state_pool::{RecurrentShape, StatePool};
use attention::{Attention, SPLIT_SEGMENTS};
use delta_net::DeltaNet;
use linear::{Linear, Matmul, Norm, PublishedDecode, QuantSource, Vector, decode_published};
use mlp::Mlp;
use moe::Moe;
pub use moe::MoeScratch;
pub use mtp::{MtpHead, MtpScratch};
use per_layer::{PerLayerBlock, PerLayerInputs};
pub use scratch::{ProductScratch, Scratch};
use short_conv::ShortConv;

/// What every block of one forward pass shares: how products run and the model's widths.
#[derive(Clone, Copy)]
struct Step<'a> {
    mm: Matmul<'a>,
    hidden: usize,
    n_heads: usize,
    eps: f32,
}

/// Elements below which row-wise work (norms, activations, residual adds) runs on the calling
/// thread alone: a pool dispatch costs a few microseconds, about what 30 thousand elements of
/// such work take.
const PARALLEL_MIN_ELEMENTS: usize = 1 << 15;

/// Calls `f(rows)` for `0..n` rows of `width` elements each, split into one contiguous range
/// per thread of `pool` when they hold at least [`PARALLEL_MIN_ELEMENTS`] elements, else once
/// on this thread. Meant for row-wise work, whose bits do not depend on the split; without it
/// one thread did a prompt's norms, activations and residual adds while the other waited
/// (BENCHMARKS.md).
fn for_row_ranges(pool: &ThreadPool, n: usize, width: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
    let parts = if n.saturating_mul(width) >= PARALLEL_MIN_ELEMENTS { pool.threads().min(n) } else { 1 };
    if parts <= 1 {
        f(0..n);
        return;
    }
    pool.run(parts, &|p| f(p * n / parts..(p + 1) * n / parts));
}

/// [`for_row_ranges`] over the rows of `out (n, width)`, handing each call its rows of `out`.
fn for_row_slices(
    pool: &ThreadPool,
    out: &mut [f32],
    width: usize,
    f: &(dyn Fn(std::ops::Range<usize>, &mut [f32]) + Sync),
) {
    let n = out.len() / width;
    let shared = SharedMut::new(out);
    for_row_ranges(pool, n, width, &|rows| {
        // SAFETY: the ranges of one call are disjoint, and `out` outlives it.
        let part = unsafe { shared.slice(rows.start * width, rows.len() * width) };
        f(rows, part);
    });
}

/// The largest number of prompt tokens run through the layers at once; longer prompts are
/// processed in chunks of this size so activation buffers stay bounded.
pub const DEFAULT_MAX_CHUNK: usize = 512;

/// What mixes information across positions in a layer. One per layer, built at load, so the
/// variants' different sizes cost nothing that a box would save.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
enum Mixer {
    /// Self-attention over the paged KV cache.
    Attention(Attention),
    /// Gated DeltaNet linear attention over a state per sequence (`delta_net.rs`).
    DeltaNet(DeltaNet),
    /// LFM2's short convolution over a state per sequence (`short_conv.rs`).
    ShortConv(ShortConv),
}

/// The layer's feed-forward block (one per layer, built at load, as [`Mixer`]).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
enum Ffn {
    /// The gated MLP.
    Dense(Mlp),
    /// Routed experts.
    Moe(Moe),
    /// Gemma 4's MLP and experts side by side.
    DenseAndMoe(Box<DenseAndMoe>),
}

/// Gemma 4's two feed-forward branches: `post_mlp_norm(mlp(h)) +
/// post_expert_norm(moe(pre_expert_norm(x)))`, with `h` the pre-normed input and the router
/// reading `x`.
#[derive(Debug, Clone)]
struct DenseAndMoe {
    mlp: Mlp,
    post_mlp_norm: Norm,
    pre_expert_norm: Norm,
    moe: Moe,
    post_expert_norm: Norm,
}

/// One decoder layer with the family's choices already made (`DecoderSpec`): which norms
/// exist around each sub-block, its mixer and feed-forward block, and Gemma 4's extras.
#[derive(Debug, Clone)]
struct Layer {
    /// Before the mixer (absent in OLMo 2).
    attn_norm: Option<Norm>,
    mixer: Mixer,
    /// After the mixer, before the residual add (Gemma, OLMo 2).
    attn_post_norm: Option<Norm>,
    /// Before the feed-forward block (absent in OLMo 2).
    mlp_norm: Option<Norm>,
    ffn: Ffn,
    /// After the feed-forward block, before the residual add (Gemma, OLMo 2).
    mlp_post_norm: Option<Norm>,
    /// Gemma 4's per-layer input block.
    per_layer: Option<PerLayerBlock>,
    /// The layer's output is multiplied by this (Gemma 4's `layer_scalar`).
    scalar: Option<f32>,
}

impl Layer {
    /// `weights` holds the scale planes of a checkpoint stored quantized and the tensors of a
    /// published quantized one (both empty otherwise). Every shape is checked here. `rope`
    /// is the index of the layer's rotary table, when it has one.
    fn new(
        w: &LayerWeights,
        index: usize,
        config: &ModelConfig,
        rope: Option<usize>,
        recurrent: usize,
        weights: &ModelWeights,
    ) -> Result<Self> {
        let spec = &config.decoder;
        let layer =
            spec.layers.get(index).copied().ok_or_else(|| {
                KylinError::config_invalid(format!("internal: the decoder plan has no layer {index}"))
            })?;
        let hidden = config.hidden_size;
        let norm = |role: Role| -> Result<Norm> { Norm::new(w.require(role, index)?, hidden, spec.norm) };
        let optional_norm =
            |wanted: bool, role: Role| -> Result<Option<Norm>> { wanted.then(|| norm(role)).transpose() };
        let per_layer = spec
            .per_layer_input
            .map(|p| PerLayerBlock::new(w, index, hidden, p.width, spec.norm, weights))
            .transpose()?;
        let scalar =
            if spec.layer_scalar { Some(Vector::new(w.require(Role::LayerScalar, index)?, 1)?.scalar()) } else { None };
        Ok(Layer {
            attn_norm: optional_norm(spec.attention_norms.pre(), Role::AttnNorm)?,
            mixer: match layer.mixer {
                MixerKind::Attention => Mixer::Attention(Attention::new(w, index, config, &layer, rope, weights)?),
                MixerKind::GatedDeltaNet => {
                    let dims = spec.linear_attention.ok_or_else(|| {
                        KylinError::config_invalid(format!(
                            "internal: layer {index} is linear attention without its sizes"
                        ))
                    })?;
                    Mixer::DeltaNet(DeltaNet::new(w, index, hidden, dims, recurrent, weights)?)
                }
                MixerKind::ShortConv => {
                    let conv = spec.short_conv.ok_or_else(|| {
                        KylinError::config_invalid(format!(
                            "internal: layer {index} is a short convolution without its sizes"
                        ))
                    })?;
                    Mixer::ShortConv(ShortConv::new(w, index, hidden, conv, recurrent, weights)?)
                }
            },
            attn_post_norm: optional_norm(spec.attention_norms.post(), Role::PostAttnNorm)?,
            mlp_norm: optional_norm(spec.mlp_norms.pre(), Role::MlpNorm)?,
            ffn: {
                let mlp = || Mlp::new(w, index, hidden, layer.intermediate, spec.activation, weights);
                let moe = || -> Result<Moe> {
                    let m = spec.moe.as_ref().ok_or_else(|| {
                        KylinError::config_invalid(format!("internal: layer {index} has experts but no MoE spec"))
                    })?;
                    Moe::new(w, index, hidden, m, weights)
                };
                match layer.ffn {
                    FfnKind::Dense => Ffn::Dense(mlp()?),
                    FfnKind::Moe => Ffn::Moe(moe()?),
                    FfnKind::DenseAndMoe => Ffn::DenseAndMoe(Box::new(DenseAndMoe {
                        mlp: mlp()?,
                        post_mlp_norm: norm(Role::PostMlpNorm1)?,
                        pre_expert_norm: norm(Role::PreExpertNorm)?,
                        moe: moe()?,
                        post_expert_norm: norm(Role::PostExpertNorm)?,
                    })),
                }
            },
            mlp_post_norm: optional_norm(spec.mlp_norms.post(), Role::PostMlpNorm)?,
            per_layer,
            scalar,
        })
    }

    /// The attention of the layer, if its mixer is attention.
    fn attention(&self) -> Option<&Attention> {
        match &self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) | Mixer::ShortConv(_) => None,
        }
    }

    fn attention_mut(&mut self) -> Option<&mut Attention> {
        match &mut self.mixer {
            Mixer::Attention(a) => Some(a),
            Mixer::DeltaNet(_) | Mixer::ShortConv(_) => None,
        }
    }

    /// The state the layer's mixer keeps per sequence, if it is recurrent.
    fn recurrent_shape(&self) -> Option<RecurrentShape> {
        match &self.mixer {
            Mixer::Attention(_) => None,
            Mixer::DeltaNet(d) => Some(d.shape()),
            Mixer::ShortConv(c) => Some(c.shape()),
        }
    }

    /// The matrices of the layer's mixer and feed-forward block with their roles (attention
    /// q, k, v, o, then the MLP's gate, up, down): the ones `--quantize` quantizes.
    fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        let mixer: Box<dyn Iterator<Item = (Role, &Linear)> + '_> = match &self.mixer {
            Mixer::Attention(a) => Box::new(a.linears()),
            Mixer::DeltaNet(d) => Box::new(d.linears()),
            Mixer::ShortConv(c) => Box::new(c.linears()),
        };
        let (mlp, moe) = self.ffn_parts();
        mixer.chain(mlp.into_iter().flat_map(Mlp::linears)).chain(moe.into_iter().flat_map(Moe::linears))
    }

    /// The layer's MLP and experts, where it has them.
    fn ffn_parts(&self) -> (Option<&Mlp>, Option<&Moe>) {
        match &self.ffn {
            Ffn::Dense(m) => (Some(m), None),
            Ffn::Moe(e) => (None, Some(e)),
            Ffn::DenseAndMoe(b) => (Some(&b.mlp), Some(&b.moe)),
        }
    }

    fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        let mixer: Box<dyn Iterator<Item = &mut Linear> + '_> = match &mut self.mixer {
            Mixer::Attention(a) => Box::new(a.linears_mut()),
            Mixer::DeltaNet(d) => Box::new(d.linears_mut()),
            Mixer::ShortConv(c) => Box::new(c.linears_mut()),
        };
        let (mlp, moe): (Option<&mut Mlp>, Option<&mut Moe>) = match &mut self.ffn {
            Ffn::Dense(m) => (Some(m), None),
            Ffn::Moe(e) => (None, Some(e)),
            Ffn::DenseAndMoe(b) => (Some(&mut b.mlp), Some(&mut b.moe)),
        };
        mixer.chain(mlp.into_iter().flat_map(Mlp::linears_mut)).chain(moe.into_iter().flat_map(Moe::linears_mut))
    }

    /// The matrices of the mixer and the dense MLP: those of the products that read a whole
    /// matrix for every token, not the experts.
    fn dense_linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        let mixer: Box<dyn Iterator<Item = &mut Linear> + '_> = match &mut self.mixer {
            Mixer::Attention(a) => Box::new(a.linears_mut()),
            Mixer::DeltaNet(d) => Box::new(d.linears_mut()),
            Mixer::ShortConv(c) => Box::new(c.linears_mut()),
        };
        let mlp = match &mut self.ffn {
            Ffn::Dense(m) => Some(m),
            Ffn::Moe(_) => None,
            Ffn::DenseAndMoe(b) => Some(&mut b.mlp),
        };
        mixer.chain(mlp.into_iter().flat_map(Mlp::linears_mut))
    }

    /// The matrices that stay as stored under `--quantize`: Gemma 4's per-layer input block,
    /// a MoE router and Qwen2-MoE's shared-expert gate.
    fn side_linears(&self) -> impl Iterator<Item = &Linear> {
        let moe = self.ffn_parts().1.into_iter().flat_map(Moe::side_linears);
        self.per_layer.iter().flat_map(|p| [&p.gate, &p.projection]).chain(moe)
    }

    fn vectors(&self) -> impl Iterator<Item = &Vector> {
        let mixer = self.attention().into_iter().flat_map(Attention::norms);
        let branches = match &self.ffn {
            Ffn::DenseAndMoe(b) => Some([&b.post_mlp_norm, &b.pre_expert_norm, &b.post_expert_norm]),
            _ => None,
        };
        let recurrent: Box<dyn Iterator<Item = &Vector> + '_> = match &self.mixer {
            Mixer::Attention(_) => Box::new(std::iter::empty()),
            Mixer::DeltaNet(d) => Box::new(d.vectors()),
            Mixer::ShortConv(c) => Box::new(c.vectors()),
        };
        [&self.attn_norm, &self.mlp_norm, &self.attn_post_norm, &self.mlp_post_norm]
            .into_iter()
            .flatten()
            .chain(mixer)
            .chain(self.per_layer.iter().map(|p| &p.post_norm))
            .chain(branches.into_iter().flatten())
            .map(|n| &n.weight)
            .chain(recurrent)
    }

    /// The recurrent mixers' convolution weights (read in place, not matrix products).
    fn conv_tensors(&self) -> impl Iterator<Item = &kylin_loader::WeightTensor> {
        match &self.mixer {
            Mixer::Attention(_) => None,
            Mixer::DeltaNet(d) => Some(d.conv_tensor()),
            Mixer::ShortConv(c) => Some(c.conv_tensor()),
        }
        .into_iter()
    }
}

/// "No block": an entry of a sliding table below the window, released (never read).
pub const NO_BLOCK: u32 = u32::MAX;

/// How a model's keys and values are split between two KV pools: the full-attention layers
/// keep every position (paged, prefix-cached); the sliding layers, when they share one window,
/// keep only the positions their window still reaches, in a pool of their own, so a long
/// context costs the full layers' memory plus a bounded window.
///
/// Only layers that compute their own keys and values hold a place; a layer reusing an
/// earlier layer's (Gemma 4) reads that layer's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvGroups {
    /// The full pool's layers in slot order, with their heads and widths.
    pub full: Vec<KvShape>,
    /// The sliding pool's (empty: every layer is in the full pool).
    pub sliding: Vec<KvShape>,
    /// Their window, when there is a sliding pool.
    pub window: Option<usize>,
}

/// The model's dimensions, from the resolved configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate: usize,
    pub vocab: usize,
    /// RMSNorm epsilon as float32 (transformers adds it to a float32 variance).
    pub eps: f32,
    /// `head_dim ** -0.5`, the attention score scale.
    pub attn_scale: f32,
}

impl Dims {
    /// `num_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
}

/// One sequence's part of a batch: `n` consecutive tokens starting at position `start` of
/// the sequence, whose earlier positions are in the KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    /// Index of the segment's first token in [`BatchPlan::ids`].
    pub t0: usize,
    pub n: usize,
    /// Position of the first token in its sequence.
    pub start: usize,
    /// The sequence's block table is `block_ids[b0..b0 + nb]` of the plan; it covers every
    /// position up to `start + n`.
    pub b0: usize,
    pub nb: usize,
    /// Its table in the sliding layers' pool (when they have one) is
    /// `sliding_block_ids[sb0..sb0 + snb]`: entries below the window of position `start` may
    /// be released ([`NO_BLOCK`]) and are never read.
    pub sb0: usize,
    pub snb: usize,
    /// Row of the logits buffer that receives the segment's last token's logits, if wanted.
    /// Rows are numbered `0..` in segment order.
    pub logits_row: Option<usize>,
    /// Every token's logits are wanted (prompt log-probabilities): rows
    /// `logits_row + 1 - n ..= logits_row` hold them, in token order.
    pub all_logits: bool,
    /// The sequence's live slot in the recurrent layers' state pool (`NO_SLOT` for a model
    /// without recurrent layers); a sequence appears in at most one segment of a plan.
    pub state: u32,
    /// For a segment whose tokens may be rejected (speculative decoding): the position where
    /// its sequence's convolution log starts (the segment's own start, or an earlier segment's
    /// of the same speculation). The recurrent layers log its convolution rows there, so that
    /// the state can be rolled back to any position from that one (`StatePool::roll_back`).
    pub log_from: Option<usize>,
}

impl Segment {
    /// How many of the segment's last tokens have their logits computed: its last one, all of
    /// them ([`Segment::all_logits`]) or none.
    pub fn logit_tokens(&self) -> usize {
        match self.logits_row {
            None => 0,
            Some(_) if self.all_logits => self.n,
            Some(_) => 1,
        }
    }
}

/// Which tokens a layer computes outputs for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outputs {
    /// Every token's, output row `t` for token `t`.
    Every,
    /// Only those of the tokens whose logits are wanted, output row `r` for logits row `r`
    /// (the last layer, when nothing reads the other rows): the other tokens' keys and values
    /// are still stored, and nothing else of theirs is computed.
    LogitRows,
}

impl Outputs {
    /// Rows of output for a step of `n` tokens under `plan`.
    pub(crate) fn rows(self, plan: &BatchPlan, n: usize) -> usize {
        match self {
            Outputs::Every => n,
            Outputs::LogitRows => plan.logit_rows,
        }
    }

    /// The tokens of `seg` that get an output, as (index of the first in the segment, its
    /// output row, count): the whole segment from row `t0`, or its [`Segment::logit_tokens`]
    /// last tokens from their logits rows.
    pub(crate) fn span(self, seg: &Segment) -> (usize, usize, usize) {
        match self {
            Outputs::Every => (0, seg.t0, seg.n),
            Outputs::LogitRows => {
                let count = seg.logit_tokens();
                (seg.n - count, seg.logits_row.map_or(0, |last| last + 1 - count), count)
            }
        }
    }
}

/// A token whose input is a row of an image's encoding instead of a row of the embedding
/// table: the image's placeholder tokens.
#[derive(Debug, Clone)]
pub struct EmbeddingRow {
    /// Index of the token in [`BatchPlan::ids`].
    pub t: usize,
    /// The image's rows, `(tokens, hidden)`, and which one.
    pub rows: std::sync::Arc<[f32]>,
    pub row: usize,
}

/// What one forward pass computes: the tokens of every segment, back to back.
/// Built anew each step into the same buffers (their capacity is planned; nothing reallocates).
#[derive(Debug, Default)]
pub struct BatchPlan {
    pub ids: Vec<u32>,
    pub segments: Vec<Segment>,
    pub block_ids: Vec<u32>,
    pub sliding_block_ids: Vec<u32>,
    /// Segments whose logits are wanted.
    pub logit_rows: usize,
    /// Multimodal RoPE positions (time, row, column) of every token, in [`BatchPlan::ids`]
    /// order; empty when every token's rotary position is its position in its sequence.
    pub positions: Vec<[u32; 3]>,
    /// The tokens whose input is an image's row (their ids in [`BatchPlan::ids`] are not
    /// looked up).
    pub embedding_rows: Vec<EmbeddingRow>,
    /// One past the last position each token attends to, in [`BatchPlan::ids`] order; empty
    /// when every token attends up to itself (causal). Gemma 3's image tokens see their whole
    /// image, which is then computed in the same step.
    pub attend_until: Vec<u32>,
    /// Whether [`BatchPlan::attend_until`] holds on the sliding-window layers only (Gemma 4's
    /// images: causal on the global layers).
    pub attend_until_sliding_only: bool,
}

impl BatchPlan {
    /// Empty buffers with room for `max_tokens` tokens, `max_segments` segments and
    /// `max_blocks` block ids.
    pub fn with_capacity(max_tokens: usize, max_segments: usize, max_blocks: usize) -> Self {
        BatchPlan {
            ids: Vec::with_capacity(max_tokens),
            segments: Vec::with_capacity(max_segments),
            block_ids: Vec::with_capacity(max_blocks),
            sliding_block_ids: Vec::with_capacity(max_blocks),
            logit_rows: 0,
            positions: Vec::with_capacity(max_tokens),
            embedding_rows: Vec::with_capacity(max_tokens),
            attend_until: Vec::with_capacity(max_tokens),
            attend_until_sliding_only: false,
        }
    }

    pub fn clear(&mut self) {
        self.ids.clear();
        self.segments.clear();
        self.block_ids.clear();
        self.sliding_block_ids.clear();
        self.logit_rows = 0;
        self.positions.clear();
        self.embedding_rows.clear();
        self.attend_until.clear();
        self.attend_until_sliding_only = false;
    }

    /// Adds a segment of `ids` at position `start` of a sequence with block table `blocks`
    /// (and `sliding` in the sliding layers' pool, empty without one) and live state slot
    /// `state` (`NO_SLOT` without recurrent layers); returns its logits row when `logits` is
    /// asked for.
    pub fn push(
        &mut self,
        ids: &[u32],
        start: usize,
        blocks: &[u32],
        sliding: &[u32],
        state: u32,
        logits: bool,
    ) -> Option<usize> {
        let logits_row = logits.then(|| {
            self.logit_rows += 1;
            self.logit_rows - 1
        });
        self.push_segment(ids, start, blocks, sliding, state, logits_row, false);
        logits_row
    }

    /// Index in [`BatchPlan::segments`] of the segment holding token `t` (`t < tokens()`).
    pub(crate) fn segment_of(&self, t: usize) -> usize {
        self.segments.partition_point(|seg| seg.t0 + seg.n <= t)
    }

    /// Adds a segment as [`BatchPlan::push`] does, asking for the logits of every one of its
    /// tokens (a request's prompt log-probabilities); returns the row of its first token, the
    /// others following in order. The scratch must have room for that many rows
    /// ([`Model::plan_scratch_with_rows`]).
    pub fn push_all_logits(&mut self, ids: &[u32], start: usize, blocks: &[u32], sliding: &[u32], state: u32) -> usize {
        let first = self.logit_rows;
        self.logit_rows += ids.len();
        let last = (!ids.is_empty()).then(|| self.logit_rows - 1);
        self.push_segment(ids, start, blocks, sliding, state, last, true);
        first
    }

    /// [`BatchPlan::push_all_logits`] for a speculative segment: the last sampled token, then
    /// proposals that verification may reject, logged from its start (see
    /// [`Segment::log_from`]).
    pub fn push_speculative(
        &mut self,
        ids: &[u32],
        start: usize,
        blocks: &[u32],
        sliding: &[u32],
        state: u32,
    ) -> usize {
        let first = self.push_all_logits(ids, start, blocks, sliding, state);
        self.log_last_from(start);
        first
    }

    /// Marks the last segment pushed as one whose tokens may be rejected, its sequence's
    /// convolution log starting at position `from` (see [`Segment::log_from`]).
    pub fn log_last_from(&mut self, from: usize) {
        if let Some(segment) = self.segments.last_mut() {
            segment.log_from = Some(from);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn push_segment(
        &mut self,
        ids: &[u32],
        start: usize,
        blocks: &[u32],
        sliding: &[u32],
        state: u32,
        logits_row: Option<usize>,
        all_logits: bool,
    ) {
        self.segments.push(Segment {
            t0: self.ids.len(),
            n: ids.len(),
            start,
            b0: self.block_ids.len(),
            nb: blocks.len(),
            sb0: self.sliding_block_ids.len(),
            snb: sliding.len(),
            logits_row,
            all_logits,
            state,
            log_from: None,
        });
        self.ids.extend_from_slice(ids);
        self.block_ids.extend_from_slice(blocks);
        self.sliding_block_ids.extend_from_slice(sliding);
    }

    pub fn tokens(&self) -> usize {
        self.ids.len()
    }

    /// The tokens whose logits are wanted, as (logits row, token index), in row order.
    pub fn logit_tokens(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        self.segments.iter().flat_map(|seg| {
            let (first, row0, count) = Outputs::LogitRows.span(seg);
            (0..count).map(move |k| (row0 + k, seg.t0 + first + k))
        })
    }
}

/// The transformer: weights bound by role, with the architecture's choices made.
#[derive(Debug, Clone)]
pub struct Model {
    dims: Dims,
    /// The rotary tables the layers use, each with the head width it is built for: the
    /// global one first, then Gemma 3's local one, then tables for other head widths
    /// (Gemma 4's global layers).
    rope_configs: Vec<(RopeConfig, usize)>,
    max_position_embeddings: usize,
    /// `[vocab, hidden]`, rows widened to f32 on lookup.
    embed: Linear,
    /// Gemma 4's per-layer inputs, computed once per token before the layers.
    per_layer_inputs: Option<PerLayerInputs>,
    /// The routed experts' shape, for planning their buffers.
    moe: Option<kylin_loader::family::MoeSpec>,
    layers: Vec<Layer>,
    final_norm: Norm,
    /// `[vocab, hidden]`; the embedding's bytes when tied.
    lm_head: Linear,
    tied: bool,
    /// The family's model-wide constants (`DecoderSpec`), as f32 where they multiply
    /// activations. This one multiplies the embedding rows (Gemma, Granite); `None` for 1.
    embedding_scale: Option<f32>,
    /// Multiplies each sub-block's output before the residual add (Granite); 1 adds plainly.
    residual_scale: f32,
    /// `cap · tanh(s / cap)` on attention scores (Gemma 2).
    attention_softcap: Option<f32>,
    /// Logits are divided by this (Granite), then soft-capped (Gemma 2).
    logits_divisor: Option<f32>,
    final_softcap: Option<f32>,
    /// The BF16 kernels when the matrix products run in `Precision::Bf16`.
    bf16: Option<Bf16Kernels>,
    /// The format the linear layers and the head were quantized to at load, if any.
    quantization: Option<QuantFormat>,
    /// Quantized weights with BF16 activations (`--quantize q8_0 --precision bf16`: every
    /// Q8_0 matrix read as `q8_0_a16`).
    quantized_bf16: bool,
    /// The head is another model's, given later (an MTP head's decoder gets the target's:
    /// `MtpHead::share_lm_head`), so it is not copied into AMX tiles here.
    head_from_target: bool,
    /// Matrices `--quantize` left as stored (columns not whole blocks of 32).
    unquantized: usize,
    /// A published checkpoint that quantizes only its experts (MXFP4).
    published_experts_only: bool,
}

impl Model {
    /// Binds the weights, checking every shape and dtype against the configuration.
    pub fn new(config: &ModelConfig, weights: &ModelWeights) -> Result<Self> {
        if config.num_heads == 0 || config.num_kv_heads == 0 || !config.num_heads.is_multiple_of(config.num_kv_heads) {
            return Err(KylinError::config_invalid(format!(
                "num_attention_heads ({}) must be a non-zero multiple of num_key_value_heads ({})",
                config.num_heads, config.num_kv_heads
            )));
        }
        if config.head_dim == 0 || config.head_dim > MAX_HEAD_DIM {
            return Err(KylinError::operator_unsupported(format!(
                "head_dim {} is outside the attention kernels' range 1..={MAX_HEAD_DIM}",
                config.head_dim
            )));
        }
        if weights.layers.len() != config.num_layers || config.decoder.layers.len() != config.num_layers {
            return Err(KylinError::config_invalid(format!(
                "num_hidden_layers is {} but {} layers were bound",
                config.num_layers,
                weights.layers.len()
            )));
        }
        let spec = &config.decoder;
        // The buffers are sized by the widest layer (Gemma 4's global layers are wider).
        let widest = |f: fn(&kylin_loader::family::LayerSpec) -> usize, global: usize| {
            spec.layers.iter().map(f).max().unwrap_or(global).max(global)
        };
        let dims = Dims {
            hidden: config.hidden_size,
            n_layers: config.num_layers,
            n_heads: config.num_heads,
            n_kv_heads: widest(|l| l.num_kv_heads, config.num_kv_heads),
            head_dim: widest(|l| l.head_dim, config.head_dim),
            intermediate: widest(|l| l.intermediate, config.intermediate_size),
            vocab: config.vocab_size,
            eps: config.rms_norm_eps as f32,
            attn_scale: spec.attention_scale as f32,
        };
        // Table 0 is the global RoPE; table 1 the local one when the family has it; then one
        // per other head width a layer needs.
        let mut rope_configs = vec![(config.rope.clone(), config.head_dim)];
        if let Some(local) = &spec.local_rope {
            rope_configs.push((local.clone(), config.head_dim));
        }
        let mut layers = Vec::with_capacity(config.num_layers);
        let mut recurrent = 0;
        for (i, w) in weights.layers.iter().enumerate() {
            let l = &spec.layers[i];
            let rope = match l.rope {
                LayerRope::None => None,
                LayerRope::Global => Some(config.rope.clone()),
                LayerRope::Local => spec.local_rope.clone(),
            };
            let table = rope.map(|r| {
                let key = (r, l.head_dim);
                match rope_configs.iter().position(|c| *c == key) {
                    Some(t) => t,
                    None => {
                        rope_configs.push(key);
                        rope_configs.len() - 1
                    }
                }
            });
            layers.push(Layer::new(w, i, config, table, recurrent, weights)?);
            if l.mixer.is_recurrent() {
                recurrent += 1;
            }
        }
        // The recurrent layers' prefix reuse and rewinds rest on the full KV pool's block
        // boundaries; a sliding window beside them would need both schemes at once.
        if recurrent > 0 && layers.iter().any(|l| l.attention().is_some_and(|a| a.window.is_some())) {
            return Err(KylinError::operator_unsupported(format!(
                "{} mixes recurrent layers with sliding-window attention, which Kylin does not run together",
                config.architecture.hf_name()
            )));
        }
        // The sliding layers get a KV pool of their own when they share one window: it holds
        // only the positions their windows still reach (`KvGroups`). A layer that reuses an
        // earlier layer's keys and values reads that layer's place and takes none of its own.
        let mut windows = layers.iter().filter_map(|l| l.attention().and_then(|a| a.window));
        let split = windows.next().is_some_and(|w| windows.all(|x| x == w));
        let (mut full, mut sliding) = (0, 0);
        for i in 0..layers.len() {
            let Some(shared) = layers[i].attention().map(|a| (a.kv_shape(), a.window)) else { continue };
            if let Some(source) = spec.layers[i].kv_source {
                let place = layers[source]
                    .attention()
                    .filter(|a| (a.kv_shape(), a.window) == shared)
                    .map(|a| (a.kv_slot, a.in_sliding_pool))
                    .ok_or_else(|| {
                        KylinError::config_invalid(format!(
                            "layer {i} reuses the keys and values of layer {source}, whose heads or window differ"
                        ))
                    })?;
                if let Some(a) = layers[i].attention_mut() {
                    (a.kv_slot, a.in_sliding_pool) = place;
                }
                continue;
            }
            let in_sliding = split && shared.1.is_some();
            let counter = if in_sliding { &mut sliding } else { &mut full };
            if let Some(a) = layers[i].attention_mut() {
                (a.kv_slot, a.in_sliding_pool) = (*counter, in_sliding);
            }
            *counter += 1;
        }
        let per_layer_inputs = match spec.per_layer_input {
            Some(p) => Some(PerLayerInputs::new(weights, p, &dims, spec.norm)?),
            None => None,
        };
        let lm_head = Linear::bind(&weights.lm_head, None, dims.vocab, dims.hidden, weights)?;
        let quantization = match config.quantization {
            None => None,
            Some(stored) => {
                let format = match stored {
                    kylin_loader::StoredQuantization::KylinQ8_0 => QuantFormat::Q8_0,
                    kylin_loader::StoredQuantization::KylinQ4K => QuantFormat::Q4K,
                };
                if lm_head.quant.is_none() {
                    return Err(KylinError::operator_unsupported(format!(
                        "a checkpoint stored in {} must store its head quantized (lm_head.weight and lm_head.weight_scale, tie_word_embeddings false), as kylin quantize writes it",
                        format.name()
                    )));
                }
                Some(format)
            }
        };
        let not_one = |v: f64| (v != 1.0).then_some(v as f32);
        Ok(Model {
            dims,
            rope_configs,
            max_position_embeddings: config.max_position_embeddings,
            embed: Linear::new(&weights.embed_tokens, None, dims.vocab, dims.hidden)?,
            per_layer_inputs,
            moe: spec.moe,
            layers,
            final_norm: Norm::new(&weights.final_norm, dims.hidden, spec.norm)?,
            lm_head,
            tied: weights.lm_head.same_bytes(&weights.embed_tokens),
            embedding_scale: not_one(spec.embedding_scale),
            residual_scale: spec.residual_scale as f32,
            attention_softcap: spec.attention_softcap.map(|c| c as f32),
            logits_divisor: not_one(spec.logits_divisor),
            final_softcap: spec.final_softcap.map(|c| c as f32),
            bf16: None,
            quantized_bf16: false,
            head_from_target: false,
            unquantized: 0,
            published_experts_only: config.published.as_ref().is_some_and(|q| !q.quantizes_linear_layers()),
            quantization,
        })
    }

    /// Quantizes every linear layer and the head to `format` (before
    /// [`Model::set_precision`] and [`Model::plan_scratch`]), with GGUF's numbers, made on
    /// `threads` threads, `progress(done, total)` called with the source bytes done after each
    /// piece. The embedding stays as stored (a lookup reads one row per token); a tied head is
    /// quantized from it. Each quantized matrix's source pages are released from resident
    /// memory as soon as it is done (the map stays: a lookup faults back the rows it reads).
    ///
    /// `Q8_0` quantizes every matrix to Q8_0. `Q4K` follows llama.cpp's Q4_K_M recipe: where
    /// that recipe asks for Q6_K (the head, and `v_proj` and `down_proj` in the layers
    /// llama.cpp's `use_more_bits` picks: the first and last eighth, and every third between)
    /// the matrix is Q6_0 (6.5 bits per weight, Q6_K's 6.5625; `q56.rs` says why not Q6_K
    /// itself), all other matrices are Q4_K. A matrix whose columns are not whole super-blocks
    /// of 256 falls back as llama.cpp's does: from Q4_K to Q5_0 (Qwen2.5-0.5B's 896 columns),
    /// from Q6_K to Q8_0. (The Q4_K kernels could run such a matrix with a partial last
    /// super-block, but measured on Qwen2.5-Coder-0.5B that costs ten times llama.cpp's KL
    /// divergence; BENCHMARKS.md.)
    ///
    /// `OPERATOR_UNSUPPORTED` naming the tensor when a matrix's columns are not whole blocks
    /// of 32.
    pub fn quantize(
        &mut self,
        format: QuantFormat,
        threads: usize,
        progress: &(dyn Fn(u64, u64) + Sync),
    ) -> Result<()> {
        use kylin_kernels::quant::GROUP_ROWS;
        if let Some(m) = self.pending().next() {
            return Err(KylinError::config_invalid(format!(
                "--quantize {} does not apply to a published quantized checkpoint (module '{}' is stored quantized): it runs on the integer kernels as published; quantize its BF16 original instead",
                format.name(),
                m.module
            )));
        }
        if self.quantization.is_some() {
            return Ok(());
        }
        let n_layers = self.layers.len();
        // llama.cpp's `use_more_bits(i_layer, n_layers)` (llama-quant.cpp), by layer index.
        let more_bits = |i: usize| i < n_layers / 8 || i >= 7 * n_layers / 8 || (i - n_layers / 8) % 3 == 2;
        let mut matrices: Vec<(&Linear, Packing)> = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (role, m) in layer.linears() {
                let wants = match format {
                    QuantFormat::Q8_0 | QuantFormat::Published(_) => Packing::Q8_0,
                    QuantFormat::Q4K
                        if matches!(role, Role::VProj | Role::DownProj | Role::ExpertDown | Role::SharedDown)
                            && more_bits(i) =>
                    {
                        Packing::Q6_0
                    }
                    QuantFormat::Q4K => Packing::Q4K,
                };
                matrices.push((m, wants));
            }
        }
        let head = if matches!(format, QuantFormat::Q4K) { Packing::Q6_0 } else { Packing::Q8_0 };
        matrices.push((&self.lm_head, head));
        // A matrix whose columns are not whole super-blocks of 256 falls back as llama.cpp's
        // Q4_K_M does (`llama_tensor_get_type`): a Q4_K one to Q5_0 (or to Q8_0 when they are
        // not whole pairs of blocks either: Q5_0's layout reads 64 columns at a time), a Q6_0
        // one (llama.cpp's Q6_K) to Q8_0. A matrix whose columns are not whole blocks of 32
        // stays as stored (llama.cpp falls back to a wider type the same way); its products
        // run in f32.
        let mut buffers: Vec<Option<QuantBuffer>> = Vec::with_capacity(matrices.len());
        for (m, packing) in matrices.iter_mut() {
            let whole_super_blocks = m.cols.is_multiple_of(kylin_kernels::q4k::QK_K);
            *packing = match *packing {
                Packing::Q4K if m.cols.is_multiple_of(64) => Packing::four_bit(m.cols),
                Packing::Q6_0 if whole_super_blocks => Packing::Q6_0,
                Packing::Q4K | Packing::Q6_0 => Packing::Q8_0,
                other => other,
            };
            buffers.push(QuantBuffer::zeroed(*packing, m.rows, m.cols));
        }
        self.unquantized = buffers.iter().filter(|b| b.is_none()).count();
        // Work items of at most `CHUNK_GROUPS` groups of 16 rows, largest matrices first.
        const CHUNK_GROUPS: usize = 64;
        let mut items = Vec::new();
        for (index, ((m, packing), buffer)) in matrices.iter().zip(buffers.iter_mut()).enumerate() {
            let Some(buffer) = buffer else { continue };
            let groups = m.rows.div_ceil(GROUP_ROWS);
            let (gq, gs) = buffer.group_bytes();
            let (quants, scales) = buffer.planes_mut();
            let pieces = quants.chunks_mut(CHUNK_GROUPS * gq).zip(scales.chunks_mut(CHUNK_GROUPS * gs));
            for (i, out) in pieces.enumerate() {
                let g0 = i * CHUNK_GROUPS;
                let g1 = (g0 + CHUNK_GROUPS).min(groups);
                let source_bytes = ((g1 * GROUP_ROWS).min(m.rows) - g0 * GROUP_ROWS) * m.cols * m.dtype.size_in_bytes();
                items.push((index, *packing, m.matrix(), g0..g1, out, source_bytes as u64));
            }
        }
        let total: u64 = items.iter().map(|item| item.5).sum();
        // Pieces left per matrix: whoever finishes a matrix's last piece releases its source
        // pages from resident memory, so the peak stays near the quantized size, not the sum.
        let mut pieces = vec![0usize; matrices.len()];
        for item in &items {
            pieces[item.0] += 1;
        }
        let left: Vec<std::sync::atomic::AtomicUsize> =
            pieces.into_iter().map(std::sync::atomic::AtomicUsize::new).collect();
        items.reverse();
        let queue = std::sync::Mutex::new(items);
        let done = std::sync::atomic::AtomicU64::new(0);
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| {
                    let mut row = Vec::new();
                    loop {
                        let Some((index, packing, w, groups, (quants, scales), bytes)) =
                            queue.lock().unwrap_or_else(|e| e.into_inner()).pop()
                        else {
                            break;
                        };
                        row.resize(w.cols, 0.0);
                        QuantBuffer::quantize_groups(packing, w, groups, quants, scales, &mut row);
                        if left[index].fetch_sub(1, std::sync::atomic::Ordering::AcqRel) == 1 {
                            // A tied head's pages are the embedding's: a lookup faults back
                            // only the rows it reads.
                            matrices[index].0.weight.advise_dont_need();
                        }
                        let now = done.fetch_add(bytes, std::sync::atomic::Ordering::Relaxed) + bytes;
                        progress(now, total);
                    }
                });
            }
        });
        let linears = self.layers.iter_mut().flat_map(|l| l.linears_mut()).chain(std::iter::once(&mut self.lm_head));
        for (linear, buffer) in linears.zip(buffers) {
            if let Some(buffer) = buffer {
                linear.quant = Some(QuantSource::Owned(Arc::new(buffer)));
            }
        }
        self.quantization = Some(format);
        Ok(())
    }

    /// Whether a linear layer quantizes its input first (a published scheme with quantized
    /// activations under `--precision f32`). The head counts too: a scheme that does not
    /// ignore it quantizes its input like any other layer's.
    fn quantizes_inputs(&self) -> bool {
        self.layers
            .iter()
            .flat_map(|l| l.linears().map(|(_, m)| m))
            .chain(std::iter::once(&self.lm_head))
            .any(|l| l.input_quant.is_some())
    }

    /// The published quantized matrices still waiting for [`Model::prepare_published`].
    fn pending(&self) -> impl Iterator<Item = &kylin_loader::published::PublishedMatrix> {
        self.layers.iter().flat_map(|l| l.linears().map(|(_, m)| m)).chain(std::iter::once(&self.lm_head)).filter_map(
            |l| match &l.quant {
                Some(QuantSource::Pending(m)) => Some(&**m),
                _ => None,
            },
        )
    }

    /// Decodes a published quantized checkpoint (compressed-tensors, FP8, GPTQ, AWQ; before
    /// [`Model::set_precision`] and [`Model::plan_scratch`]; nothing to do for any other model),
    /// on `threads` threads:
    ///
    /// - `F32`: every quantized matrix is dequantized exactly to f32 (`scale · (q − zero)`, FP8
    ///   times its scale), the weights transformers computes with; the activations stay f32.
    /// - `Auto` (the default): the integer kernels. 8-bit symmetric integers with groups of a
    ///   multiple of 32 (W8A8, W8A16) keep their integers and scale per block in Q8_0's planes;
    ///   4-bit integers with groups of a multiple of 32 and no activation order (W4A16, GPTQ,
    ///   AWQ) keep theirs in Q4G's, with the scale and `scale · zero` per group (f16). Where the
    ///   CPU has AVX-512 BF16 ([`kernels::w16::available`]), every scheme but W8A8 (whose
    ///   producer quantized the activations to int8) runs with BF16 activations: `q8_0_a16`,
    ///   `q4_g_a16`, and FP8 as stored (`f8_e4m3_a16`, decoded in the kernel, one f32 scale
    ///   per row and 32 columns). Elsewhere the int8 products run (`q8_0`, `q4_g`) and FP8 is
    ///   dequantized and quantized to Q8_0. Activation order and asymmetric 8-bit are
    ///   dequantized and quantized to Q8_0 everywhere. Unquantized modules (`ignore`, usually
    ///   the head) become Q8_0, as under `--quantize`.
    /// - `Bf16`: every quantized matrix is dequantized and rounded to BF16, for the BF16 kernels
    ///   (BF16 activations; twice the bytes per token of Q8_0, four times Q4G's, for 16-bit
    ///   activations as the A16 schemes intend). `CONFIG_INVALID` without BF16 kernels.
    ///
    /// Errors name the tensor whose values are wrong (`FILE_CORRUPTED`, `TENSOR_SHAPE_MISMATCH`).
    pub fn prepare_published(&mut self, choice: PrecisionChoice, threads: usize) -> Result<()> {
        if self.pending().next().is_none() {
            return Ok(());
        }
        let mode = match choice {
            PrecisionChoice::F32 => PublishedDecode::F32,
            PrecisionChoice::Bf16 => PublishedDecode::Bf16,
            PrecisionChoice::Auto => PublishedDecode::Integer,
            PrecisionChoice::Int8 => PublishedDecode::Int8,
        };
        if mode == PublishedDecode::Bf16 && kernels::bf16_kernels().is_none() {
            return Err(KylinError::config_invalid(format!(
                "--precision bf16 needs BF16 matrix kernels (AMX-BF16 or AVX-512 BF16), which this CPU lacks (kernels: {}); use --precision auto (integer kernels, the default) or f32 (the exactly dequantized weights)",
                kernels::kernel_family(Precision::F32)
            )));
        }
        let integer = matches!(mode, PublishedDecode::Integer | PublishedDecode::Int8);
        // MXFP4 checkpoints quantize only their experts; their attention and head stay as
        // stored (every other published scheme's unquantized modules become Q8_0).
        let keep_floats = self.published_experts_only;
        let linears: Vec<&mut Linear> = self
            .layers
            .iter_mut()
            .flat_map(|l| l.linears_mut())
            .chain(std::iter::once(&mut self.lm_head))
            .filter(|l| {
                matches!(l.quant, Some(QuantSource::Pending(_)))
                    || (mode != PublishedDecode::F32 && l.quant.is_none() && !keep_floats)
            })
            .collect();
        let queue = std::sync::Mutex::new(linears);
        let failure: std::sync::Mutex<Option<KylinError>> = std::sync::Mutex::new(None);
        let packings = std::sync::Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for _ in 0..threads.max(1) {
                scope.spawn(|| {
                    loop {
                        if failure.lock().unwrap_or_else(|e| e.into_inner()).is_some() {
                            break;
                        }
                        let Some(linear) = queue.lock().unwrap_or_else(|e| e.into_inner()).pop() else { break };
                        match decode_published(linear, mode) {
                            Ok(p) => packings.lock().unwrap_or_else(|e| e.into_inner()).extend(p),
                            Err(e) => {
                                failure.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert(e);
                                break;
                            }
                        }
                    }
                });
            }
        });
        if let Some(e) = failure.into_inner().unwrap_or_else(|e| e.into_inner()) {
            return Err(e);
        }
        if integer {
            // Reported by the packing most matrices got (Q4G for a 4-bit checkpoint); ties go
            // to the first in `Packing`'s order.
            let packings = packings.into_inner().unwrap_or_else(|e| e.into_inner());
            let mut counts: Vec<(Packing, usize)> = Vec::new();
            for p in packings {
                match counts.iter_mut().find(|(q, _)| *q == p) {
                    Some((_, n)) => *n += 1,
                    None => counts.push((p, 1)),
                }
            }
            counts.sort_by_key(|&(p, n)| (std::cmp::Reverse(n), p as u8));
            let packing = counts.first().map_or(Packing::Q8_0, |&(p, _)| p);
            self.quantization = Some(QuantFormat::Published(packing));
        }
        Ok(())
    }

    /// The quantized matrices, for `kylin quantize` to store: `(name, planes)` for every layer's
    /// projections (their checkpoint names) and the head (`lm_head.weight`, also when it was
    /// tied to the embedding). Empty unless quantized.
    pub fn quantized_matrices(&self) -> Vec<(String, QuantMatrix<'_>)> {
        let layers = self.layers.iter().flat_map(|l| l.linears()).map(|(_, m)| (m.weight.name.clone(), m));
        layers
            .chain(std::iter::once(("lm_head.weight".to_string(), &self.lm_head)))
            .filter_map(|(name, m)| m.quant_matrix().map(|q| (name, q)))
            .collect()
    }

    /// How many matrices `--quantize` left in their stored dtype because their columns are not
    /// whole blocks of 32.
    pub fn unquantized_matrices(&self) -> usize {
        self.unquantized
    }

    /// The format the linear layers were quantized to at load, if any.
    pub fn quantization(&self) -> Option<QuantFormat> {
        self.quantization
    }

    /// The KV cache's element type when none is asked for: BF16 under `Precision::Bf16` (what
    /// transformers keeps for a BF16 model), F16 for a quantized model (llama.cpp's default;
    /// measured closest to f32 of the 16-bit types, see BENCHMARKS.md), f32 otherwise (exact
    /// against the float32 references).
    pub fn default_kv_dtype(&self) -> WeightDType {
        match (self.quantization, self.precision()) {
            // Experts-only quantization with the rest on the BF16 kernels: attention as a BF16
            // model runs it.
            (Some(_), Precision::Bf16) if self.published_experts_only => WeightDType::BF16,
            (Some(_), _) => WeightDType::F16,
            (None, Precision::Bf16) => WeightDType::BF16,
            (None, Precision::F32) => WeightDType::F32,
        }
    }

    /// Chooses the arithmetic of the matrix products (before [`Model::plan_scratch`]).
    ///
    /// `CONFIG_INVALID` for `Bf16` when a matrix is not stored in BF16 (naming it and its
    /// dtype) or the CPU has no BF16 kernels.
    pub fn set_precision(&mut self, choice: PrecisionChoice) -> Result<()> {
        if let Some(format) = self.quantization {
            // The quantized products have their own arithmetic: int8 activations by default;
            // BF16 activations over Q8_0 weights on request.
            self.bf16 = None;
            return match choice {
                PrecisionChoice::Auto | PrecisionChoice::Int8 if self.published_experts_only => {
                    // gpt-oss as published: MXFP4 experts beside BF16 attention and head. The
                    // experts keep their integer kernels; the float half runs on the BF16
                    // kernels, as a BF16 model's would, when every one of its matrices is BF16.
                    let float_not_bf16 =
                        self.product_linears().any(|m| m.quant.is_none() && m.dtype != WeightDType::BF16);
                    self.bf16 = kernels::bf16_kernels().filter(|_| !float_not_bf16);
                    self.repack_bf16();
                    Ok(())
                }
                PrecisionChoice::Auto | PrecisionChoice::Int8 => Ok(()),
                PrecisionChoice::Bf16 => self.run_quantized_on_bf16_activations(format),
                PrecisionChoice::F32 => Err(KylinError::config_invalid(format!(
                    "--precision f32 does not apply to --quantize {}: its matrix products quantize the activations to int8 (or, with --precision bf16, round them to BF16); use --precision auto (the default)",
                    format.name()
                ))),
            };
        }
        let non_bf16 = self.product_linears().find(|m| m.dtype != WeightDType::BF16);
        self.bf16 = match choice {
            PrecisionChoice::Int8 => {
                return Err(KylinError::config_invalid(format!(
                    "--precision int8 applies to quantized weights (--quantize q8_0|q4_k, or a published quantized checkpoint); this model's matrices are stored as {:?}: add --quantize, or use --precision auto",
                    self.product_linears().next().map_or(WeightDType::F32, |m| m.dtype)
                )));
            }
            PrecisionChoice::F32 => None,
            PrecisionChoice::Auto => kernels::bf16_kernels().filter(|_| non_bf16.is_none()),
            PrecisionChoice::Bf16 => {
                if let Some(m) = non_bf16 {
                    return Err(KylinError::config_invalid(format!(
                        "--precision bf16 needs BF16 weights; tensor '{}' is stored as {:?}; use --precision f32 or auto",
                        m.weight.name, m.dtype
                    )));
                }
                let Some(k) = kernels::bf16_kernels() else {
                    return Err(KylinError::config_invalid(format!(
                        "--precision bf16 needs BF16 matrix kernels (AMX-BF16 or AVX-512 BF16), which this CPU lacks (kernels: {}); use --precision f32 or auto",
                        kernels::kernel_family(Precision::F32)
                    )));
                };
                Some(k)
            }
        };
        self.repack_bf16();
        Ok(())
    }

    /// Repacks the BF16 matrices that every token reads whole (the mixers', the dense MLPs', the
    /// per-layer input projection and the head) into the layout their products read: AMX tiles
    /// under `Precision::Bf16` on AMX ([`Linear::tile_for_amx`]), 16-row strips for the f32
    /// products on AVX2 without AVX-512 ([`Linear::strip_for_avx2`]); drops a layout the
    /// products no longer read. Experts stay in place in the map: a copy would touch cold
    /// experts, and their grouped products read them row-major.
    fn repack_bf16(&mut self) {
        let amx = self.bf16 == Some(Bf16Kernels::Amx);
        // The head first: while a matrix is copied, its source pages and its copy are both
        // resident, so the largest goes while nothing else has been copied yet (the peak is
        // then the model plus one layer's matrix, not plus the head).
        let head = (!self.head_from_target).then_some(&mut self.lm_head);
        let linears = head
            .into_iter()
            .chain(self.layers.iter_mut().flat_map(|l| l.dense_linears_mut()))
            .chain(self.per_layer_inputs.as_mut().map(|p| &mut p.projection));
        // On AVX2 without AVX-512 the f32 products read BF16 weights in strips instead.
        let f32_products = self.bf16.is_none();
        for linear in linears {
            if amx {
                linear.tile_for_amx();
            } else {
                linear.tiles = None;
            }
            if f32_products {
                linear.strip_for_avx2();
            } else {
                linear.strips = None;
            }
        }
    }

    /// Every matrix of the model's products: the layers' (with the routers and gates), the
    /// per-layer input projection and the head.
    fn product_linears(&self) -> impl Iterator<Item = &Linear> {
        self.layers
            .iter()
            .flat_map(|l| l.linears().map(|(_, m)| m).chain(l.side_linears()))
            .chain(self.per_layer_inputs.as_ref().map(|p| &p.projection))
            .chain(std::iter::once(&self.lm_head))
    }

    /// `--quantize q8_0 --precision bf16`: every Q8_0 matrix (made at load or stored by `kylin
    /// quantize`) is read as `q8_0_a16`, the same planes with BF16 activations. `CONFIG_INVALID`
    /// without AVX-512 BF16, for Q4_K (no BF16-activation kernel reads its 6-bit scales) and for
    /// a published checkpoint (whose `--precision bf16` path is decided at load).
    fn run_quantized_on_bf16_activations(&mut self, format: QuantFormat) -> Result<()> {
        if format != QuantFormat::Q8_0 {
            return Err(KylinError::config_invalid(format!(
                "--precision bf16 with --quantize {} is not supported: BF16 activations run over Q8_0 weights only; use --quantize q8_0, or --precision auto (int8 activations)",
                format.name()
            )));
        }
        if !kernels::w16::available() {
            return Err(KylinError::config_invalid(format!(
                "--precision bf16 with --quantize q8_0 needs AVX-512 BF16, which this CPU lacks (kernels: {}); use --precision auto (int8 activations)",
                kernels::quant::q8_kernels()
            )));
        }
        for linear in self.layers.iter_mut().flat_map(|l| l.linears_mut()).chain(std::iter::once(&mut self.lm_head)) {
            match &mut linear.quant {
                Some(QuantSource::Owned(buffer)) => {
                    // Made by `Model::quantize` and not shared yet.
                    let Some(buffer) = Arc::get_mut(buffer) else {
                        return Err(KylinError::config_invalid("the quantized matrices are already in use"));
                    };
                    buffer.set_packing(Packing::Q8_0A16);
                }
                Some(QuantSource::Mapped { packing, .. }) => {
                    if *packing == Packing::Q8_0 {
                        *packing = Packing::Q8_0A16;
                    }
                }
                Some(QuantSource::Pending(_)) | None => {}
            }
        }
        self.quantized_bf16 = true;
        Ok(())
    }

    /// The arithmetic of the matrix products.
    pub fn precision(&self) -> Precision {
        if self.bf16.is_some() { Precision::Bf16 } else { Precision::F32 }
    }

    /// The arithmetic attention may take ([`kernels::paged::attention_path`] then picks its
    /// path by the KV cache's element type too): the products' under `--precision bf16` or f32,
    /// and BF16 for a quantized model where the CPU has BF16 kernels. A quantized model's
    /// products already quantize (or round) their inputs, so over a BF16 cache (`--kv-dtype
    /// bf16`) its attention takes the BF16 path, `S = bf16(Q) · Kᵀ`, `O += bf16(P) · V` with f32
    /// sums, as a BF16 model's does; over its default F16 cache (or an f32 one) it stays f32.
    pub fn attention_precision(&self) -> Precision {
        if self.quantization.is_some() && kernels::bf16_kernels().is_some() {
            Precision::Bf16
        } else {
            self.precision()
        }
    }

    /// The kernel family running the matrix products (`amx-bf16`, `avx512`, `avx2`, `scalar`,
    /// or for a quantized model `avx512-vnni q8_0`, `amx-bf16 q4_g_a16`, ...).
    pub fn kernel_family(&self) -> String {
        match self.quantization {
            Some(format) if self.quantized_bf16 => format!("{} {}_a16", kernels::w16::family(), format.name()),
            Some(format) if self.bf16_activations(format) => format!("{} {}", kernels::w16::family(), format.name()),
            Some(format @ (QuantFormat::Q4K | QuantFormat::Published(Packing::Q4G))) => {
                format!("{} {}", kernels::quant::q4k_kernels(), format.name())
            }
            Some(format) => format!("{} {}", kernels::quant::q8_kernels(), format.name()),
            None => kernels::kernel_family(self.precision()).to_string(),
        }
    }

    /// Whether most of a quantized model's products run on BF16 activations (the `_a16`
    /// packings of `kylin_kernels::w16`).
    fn bf16_activations(&self, format: QuantFormat) -> bool {
        self.quantized_bf16
            || matches!(format, QuantFormat::Published(p) if p.activation_kind() == kernels::quant::ActivationKind::Bf16)
    }

    /// The arithmetic of the matrix products for reports: `f32`, `bf16`, `int8` (quantized, int8
    /// activations) or `bf16 activations` (quantized weights, BF16 activations); a checkpoint
    /// that publishes only its experts quantized (gpt-oss's MXFP4) names both halves.
    pub fn precision_name(&self) -> &'static str {
        match (self.quantization, self.precision()) {
            (Some(_), Precision::Bf16) if self.published_experts_only => "int8 experts, bf16 elsewhere",
            (Some(_), Precision::F32) if self.published_experts_only => "int8 experts, f32 elsewhere",
            (Some(format), _) if self.bf16_activations(format) => "bf16 activations",
            (Some(_), _) => "int8",
            (None, Precision::Bf16) => "bf16",
            (None, Precision::F32) => "f32",
        }
    }

    /// What reports name as the kernels: the matrix products' family, and attention's path
    /// over a KV cache of `kv_dtype` when it differs (`amx-bf16`, or `avx512, attention f32`).
    pub fn kernels_report(&self, kv_dtype: WeightDType, block_size: usize) -> String {
        let attention = kernels::paged::attention_path(
            self.attention_precision(),
            kv_dtype,
            self.attention_head_dim(),
            block_size,
            self.attention_needs(),
        );
        let family = self.kernel_family();
        if attention.name() == family { family } else { format!("{family}, attention {}", attention.name()) }
    }

    pub fn dims(&self) -> &Dims {
        &self.dims
    }

    pub fn max_position_embeddings(&self) -> usize {
        self.max_position_embeddings
    }

    /// Number of parameters (a tied head counted once).
    pub fn parameter_count(&self) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                l.linears().map(|(_, m)| m).chain(l.side_linears()).map(Linear::element_count).sum::<u64>()
                    + l.vectors().map(|v| v.tensor.element_count() as u64).sum::<u64>()
                    + l.conv_tensors().map(|t| t.element_count() as u64).sum::<u64>()
            })
            .sum();
        let head = if self.tied { 0 } else { self.lm_head.element_count() };
        let per_layer = self.per_layer_inputs.as_ref().map_or(0, |p| {
            p.embed.element_count() + p.projection.element_count() + p.norm.weight.tensor.element_count() as u64
        });
        self.embed.element_count() + per_layer + layers + self.final_norm.weight.tensor.element_count() as u64 + head
    }

    /// Bytes of weights read to produce one token: every matrix and vector once (of a layer's
    /// routed experts, `top_k` of them), the head once, and one embedding row (and one row of
    /// the per-layer embedding). For a Mixture-of-Experts model this is a fraction of
    /// [`Model::weight_bytes_resident`].
    pub fn weight_bytes_per_token(&self) -> u64 {
        self.weight_bytes(true)
    }

    /// Bytes of all the weights the forward pass may read (every expert), as the memory
    /// budget counts them; the embeddings count one row each, since a lookup touches only the
    /// rows it reads.
    pub fn weight_bytes_resident(&self) -> u64 {
        self.weight_bytes(false)
    }

    fn weight_bytes(&self, per_token: bool) -> u64 {
        let layers: u64 = self
            .layers
            .iter()
            .map(|l| {
                let (mlp, moe) = l.ffn_parts();
                let mixer: u64 = match &l.mixer {
                    Mixer::Attention(a) => a.linears().map(|(_, m)| m.byte_len()).sum::<u64>() + a.sink_bytes,
                    Mixer::DeltaNet(d) => d.linears().map(|(_, m)| m.byte_len()).sum(),
                    Mixer::ShortConv(c) => c.linears().map(|(_, m)| m.byte_len()).sum(),
                };
                let mlp: u64 = mlp.into_iter().flat_map(Mlp::linears).map(|(_, m)| m.byte_len()).sum();
                let moe: u64 = moe.map_or(0, |m| if per_token { m.bytes_per_token() } else { m.bytes_resident() });
                let per_layer: u64 =
                    l.per_layer.iter().flat_map(|p| [&p.gate, &p.projection]).map(Linear::byte_len).sum();
                mixer
                    + mlp
                    + moe
                    + per_layer
                    + l.vectors().map(|v| v.tensor.byte_len() as u64).sum::<u64>()
                    + l.conv_tensors().map(|t| t.byte_len() as u64).sum::<u64>()
            })
            .sum();
        let embed_row = (self.dims.hidden * self.embed.dtype.size_in_bytes()) as u64;
        let per_layer = self.per_layer_inputs.as_ref().map_or(0, |p| {
            (p.embed.cols * p.embed.dtype.size_in_bytes()) as u64
                + p.projection.byte_len()
                + p.norm.weight.tensor.byte_len() as u64
        });
        layers + per_layer + self.final_norm.weight.tensor.byte_len() as u64 + self.lm_head.byte_len() + embed_row
    }

    /// Plans the activation buffers for forward passes of up to `max_tokens` tokens in up to
    /// `max_segments` segments (attention needs no buffer sized by the context: its state is
    /// per tile). `CONFIG_INVALID` if a size overflows.
    pub fn plan_scratch(&self, max_tokens: usize, max_segments: usize, context: usize) -> Result<Scratch> {
        self.plan_scratch_with_rows(max_tokens, max_segments, context, 0)
    }

    /// [`Model::plan_scratch`] with room for `extra_logit_rows` logits rows beyond one per
    /// segment: the rows of the segments that want every token's logits
    /// ([`BatchPlan::push_all_logits`]).
    pub fn plan_scratch_with_rows(
        &self,
        max_tokens: usize,
        max_segments: usize,
        context: usize,
        extra_logit_rows: usize,
    ) -> Result<Scratch> {
        if let Some(m) = self.pending().next() {
            return Err(KylinError::config_invalid(format!(
                "internal: module '{}' of a published quantized checkpoint was not decoded (Model::prepare_published)",
                m.module
            )));
        }
        let d = &self.dims;
        let max_tokens = max_tokens.max(1);
        let max_segments = max_segments.clamp(1, max_tokens);
        let max_logit_rows = max_segments.saturating_add(extra_logit_rows.min(max_tokens));
        let split_segments = SPLIT_SEGMENTS.min(max_segments);
        let split_parts = context.div_ceil(PARTITION).max(1);
        let split_rows = split_segments * d.n_heads * split_parts;
        let (ple_width, ple_all) = self.per_layer_inputs.as_ref().map_or((0, 0), |p| (p.width, p.embed.cols));
        // The recurrent mixers' widths: (input projection, convolution, gate/output, value
        // heads, value head width).
        let mut lin = (0usize, 0usize, 0usize, 0usize, 0usize);
        for shape in self.recurrent_layers() {
            let widths = match shape {
                RecurrentShape::DeltaNet { heads, dv, channels, .. } => (channels, channels, heads * dv, heads, dv),
                RecurrentShape::ShortConv { channels, .. } => (3 * channels, channels, channels, 0, 0),
            };
            lin = (
                lin.0.max(widths.0),
                lin.1.max(widths.1),
                lin.2.max(widths.2),
                lin.3.max(widths.3),
                lin.4.max(widths.4),
            );
        }
        let grouped = self
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::DeltaNet(d) => Some(d.grouped_width()),
                _ => None,
            })
            .max()
            .unwrap_or(0);
        let gated = self.attentions().any(Attention::has_output_gate);
        let sized = |rows: usize, cols: usize, what: &str| -> Result<Vec<f32>> {
            let len = rows.checked_mul(cols).ok_or_else(|| {
                KylinError::config_invalid(format!(
                    "{what} buffer of {rows} x {cols} overflows; pass a smaller --ctx-size or --max-batch-tokens"
                ))
            })?;
            Ok(vec![0.0; len])
        };
        Ok(Scratch {
            max_tokens,
            max_segments,
            max_logit_rows,
            keep_hidden: false,
            last_layer_rows: 0,
            x: sized(max_tokens, d.hidden, "residual")?,
            xn: sized(max_tokens, d.hidden, "norm")?,
            q: sized(max_tokens, d.q_dim(), "query")?,
            k: sized(max_tokens, d.kv_dim(), "key")?,
            v: sized(max_tokens, d.kv_dim(), "value")?,
            attn: sized(max_tokens, d.q_dim(), "attention")?,
            proj: sized(max_tokens, d.hidden, "projection")?,
            gate: sized(max_tokens, d.intermediate, "gate")?,
            up: sized(max_tokens, d.intermediate, "up")?,
            attention_tasks: vec![0; max_segments + 1],
            split_segments,
            split_parts,
            split_outputs: sized(split_rows, d.head_dim, "split attention")?,
            split_stats: vec![PartialStats::EMPTY; split_rows],
            head_tmp: sized(1, d.q_dim().max(d.head_dim), "head")?,
            rope_tmp: sized(1, self.attentions().map(|a| a.head_dim).fold(d.head_dim, usize::max), "rotary")?,
            logit_hidden: sized(max_logit_rows, d.hidden, "hidden")?,
            logits: sized(max_logit_rows, d.vocab, "logits")?,
            ple: sized(max_tokens, ple_all, "per-layer input")?,
            ple_row: sized(1, ple_all, "per-layer input")?,
            ple_gate: sized(max_tokens, ple_width, "per-layer gate")?,
            moe: MoeScratch::plan(
                self.moe.as_ref(),
                max_tokens,
                d.hidden,
                self.layers.iter().any(|l| matches!(l.ffn, Ffn::DenseAndMoe(_))),
            )
            .ok_or_else(|| {
                KylinError::config_invalid("the experts' buffers overflow; pass a smaller --max-batch-tokens")
            })?,
            q_gate: sized(max_tokens, if gated { 2 * d.q_dim() } else { 0 }, "gated query")?,
            lin_in: sized(max_tokens, lin.0, "linear-attention projection")?,
            lin_mixed: sized(max_tokens, lin.1, "convolution")?,
            lin_z: sized(max_tokens, lin.2, "linear-attention gate")?,
            lin_gates: sized(2 * max_tokens, lin.3, "linear-attention decay")?,
            lin_beta: sized(max_tokens, 2 * lin.3, "linear-attention decay")?,
            lin_core: sized(max_tokens, lin.2, "linear-attention output")?,
            lin_tmp: sized(1, lin.4, "linear-attention head")?,
            lin_grouped: sized(max_tokens, grouped, "grouped linear-attention projection")?,
            products: {
                let expert_width = self.moe.map_or(0, |m| m.intermediate.max(m.shared_intermediate.unwrap_or(0)));
                let widest = d.hidden.max(d.q_dim()).max(d.intermediate).max(ple_width).max(expert_width);
                ProductScratch {
                    xb: if self.bf16.is_some() {
                        vec![0; kernels::bf16_scratch_len(max_tokens, widest)]
                    } else {
                        Vec::new()
                    },
                    xq: if self.quantization.is_some() {
                        vec![0; kernels::quant::quant_scratch_len(max_tokens, widest)]
                    } else {
                        Vec::new()
                    },
                    xa: if self.quantizes_inputs() {
                        sized(max_tokens, widest, "quantized input")?
                    } else {
                        Vec::new()
                    },
                }
            },
        })
    }

    /// The state each recurrent layer (Gated DeltaNet, short convolution) keeps per sequence,
    /// in layer order; empty for a model without them.
    pub fn recurrent_layers(&self) -> Vec<RecurrentShape> {
        self.layers.iter().filter_map(Layer::recurrent_shape).collect()
    }

    /// Whether the model's rotary positions are multimodal (an image token has a time, row and
    /// column position): the plan then carries every token's positions.
    pub fn multimodal_rope(&self) -> bool {
        self.rope_configs.iter().any(|(c, _)| c.multimodal.is_some())
    }

    /// RoPE tables for positions `0..context`, one per rotary table the layers use.
    pub fn rope(&self, context: usize) -> Result<Ropes> {
        Ropes::new(&self.rope_configs, context)
    }

    /// How the layers' keys and values are split between the KV pools.
    pub fn kv_groups(&self) -> KvGroups {
        // The layers that hold a place, in slot order (slots are given out in layer order).
        let owners = |sliding: bool| -> Vec<KvShape> {
            self.attentions().filter(|a| a.owns_kv() && a.in_sliding_pool == sliding).map(Attention::kv_shape).collect()
        };
        KvGroups {
            full: owners(false),
            sliding: owners(true),
            window: self.attentions().find(|a| a.in_sliding_pool).and_then(|a| a.window),
        }
    }

    /// The head width that decides the attention path (its kernels need every layer's width
    /// to be a multiple of 32): a width that is not, if some layer has one, else the widest.
    pub fn attention_head_dim(&self) -> usize {
        let widths = || self.attentions().map(|a| a.head_dim);
        widths().find(|w| !w.is_multiple_of(32)).unwrap_or_else(|| widths().max().unwrap_or(self.dims.head_dim))
    }

    /// Whether some layer slides (attention over a window of positions).
    pub fn has_window(&self) -> bool {
        self.attentions().any(|a| a.window.is_some())
    }

    /// The attention of every layer whose mixer is attention.
    fn attentions(&self) -> impl Iterator<Item = &Attention> {
        self.layers.iter().filter_map(Layer::attention)
    }

    /// What the attention layers ask of the kernels beyond plain causal attention (a window,
    /// a soft cap), for the choice of the attention path and the KV cache's layout.
    pub fn attention_needs(&self) -> kernels::paged::AttentionNeeds {
        kernels::paged::AttentionNeeds { window: self.has_window(), softcap: self.attention_softcap.is_some() }
    }

    /// [`Model::forward`] of `plan` after preparing `rope`'s tables up to the plan's last
    /// position: what the engine and a draft model run each pass.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_plan(
        &self,
        pool: &ThreadPool,
        kv: &mut KvPool,
        sliding_kv: Option<&mut KvPool>,
        states: Option<&mut StatePool>,
        rope: &mut Ropes,
        s: &mut Scratch,
        plan: &BatchPlan,
        all_logits: Option<&mut [f32]>,
    ) {
        let end = plan.segments.iter().map(|seg| seg.start + seg.n).max().unwrap_or(0);
        rope.prepare(0, end);
        self.forward(pool, kv, sliding_kv, states, rope, s, plan, all_logits);
    }

    /// One forward pass over every segment of `plan`: appends each segment's keys and values to
    /// its blocks in `kv` and writes the logits of the segments that want them into `s`
    /// (read them with [`Scratch::logits`]). With `all_logits`, the plan must hold one segment,
    /// and the logits of all its positions are written there, `(n, vocab)`.
    ///
    /// The caller guarantees (the engine plans it so): at most `max_tokens` tokens and
    /// `max_segments` segments, ids inside the vocabulary, block tables covering every position
    /// up to `start + n <= context`, and RoPE prepared for those positions. Allocates nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        pool: &ThreadPool,
        kv: &mut KvPool,
        sliding_kv: Option<&mut KvPool>,
        states: Option<&mut StatePool>,
        rope: &Ropes,
        s: &mut Scratch,
        plan: &BatchPlan,
        all_logits: Option<&mut [f32]>,
    ) {
        let d = &self.dims;
        let n = plan.tokens();
        let h = d.hidden;
        assert!(n <= s.max_tokens && plan.segments.len() <= s.max_segments, "batch larger than planned");

        // 1. Embedding lookup: ids (n) -> x (n, hidden), times the embedding scale if any; an
        //    image's placeholder tokens take the image's rows instead (not scaled).
        let embed = self.embed.matrix();
        for (&id, row) in plan.ids.iter().zip(s.x.chunks_exact_mut(h)) {
            if id as usize >= d.vocab {
                // Planned with an image row below (the engine gives image tokens ids past the
                // vocabulary, so the prefix cache keys them by the image's content).
                continue;
            }
            kernels::widen_row(embed, id as usize, row);
            if let Some(scale) = self.embedding_scale {
                kernels::scale(row, scale);
            }
        }
        for e in &plan.embedding_rows {
            s.x[e.t * h..(e.t + 1) * h].copy_from_slice(&e.rows[e.row * h..(e.row + 1) * h]);
        }
        self.forward_embedded(pool, kv, sliding_kv, states, rope, s, plan, all_logits);
    }

    /// [`Model::forward`] from its input rows on: the residual stream `s.x (n, hidden)` holds
    /// the plan's input rows (the embedding lookup's, or the MTP head's projection of them).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_embedded(
        &self,
        pool: &ThreadPool,
        kv: &mut KvPool,
        mut sliding_kv: Option<&mut KvPool>,
        mut states: Option<&mut StatePool>,
        rope: &Ropes,
        s: &mut Scratch,
        plan: &BatchPlan,
        all_logits: Option<&mut [f32]>,
    ) {
        let d = &self.dims;
        let n = plan.tokens();
        let h = d.hidden;
        let mm = Matmul { pool, bf16: self.bf16 };
        assert!(n <= s.max_tokens && plan.segments.len() <= s.max_segments, "batch larger than planned");
        assert!(plan.logit_rows <= s.max_logit_rows, "more logits rows than planned");

        // Gemma 4's per-layer inputs: x (n, hidden) -> ple (n, layers · width).
        if let Some(p) = &self.per_layer_inputs {
            let all = p.embed.cols;
            p.compute(
                mm,
                &plan.ids,
                &s.x[..n * h],
                &mut s.ple[..n * all],
                &mut s.ple_row[..all],
                d.eps,
                &mut s.products,
            );
        }

        // 2. The decoder layers, each updating the residual stream x (n, hidden) in place:
        //    x += r · post_norm?(mixer(norm?(x))); x += r · post_norm?(ffn(norm?(x))); then
        //    Gemma 4's per-layer input block and layer scalar.
        //    The last layer computes outputs only for the tokens whose logits are wanted when
        //    nothing reads the other rows (not for `all_logits`, not when an MTP head reads every
        //    hidden row): the other tokens' keys and values are stored, nothing else of theirs
        //    is computed, and from its mixer's output on the layer works on the wanted rows
        //    alone, in logits-row order. Each row is its own product and norm, so the wanted
        //    rows' bits are the same either way.
        let step = Step { mm, hidden: h, n_heads: d.n_heads, eps: d.eps };
        let trimmed = all_logits.is_none() && !s.keep_hidden && plan.logit_rows < n;
        let last = self.layers.len().saturating_sub(1);
        let mut n = n;
        for (i, layer) in self.layers.iter().enumerate() {
            let outputs = if trimmed && i == last { Outputs::LogitRows } else { Outputs::Every };
            if let Some(norm) = &layer.attn_norm {
                norm.rows(pool, &s.x[..n * h], h, d.eps, &mut s.xn[..n * h]);
            }
            match &layer.mixer {
                Mixer::Attention(a) => {
                    // The layer's pool: the sliding layers' own when it has one.
                    let pool = match (&mut sliding_kv, a.in_sliding_pool) {
                        (Some(sliding), true) => &mut **sliding,
                        _ => &mut *kv,
                    };
                    a.forward(&step, pool, rope, s, plan, layer.attn_norm.is_some(), outputs);
                }
                Mixer::DeltaNet(d) => {
                    let states = states.as_deref_mut().expect("the engine passes a state pool to recurrent models");
                    d.forward(&step, states, s, plan, layer.attn_norm.is_some());
                }
                Mixer::ShortConv(c) => {
                    let states = states.as_deref_mut().expect("the engine passes a state pool to recurrent models");
                    c.forward(&step, states, s, plan, layer.attn_norm.is_some());
                }
            }
            if outputs == Outputs::LogitRows {
                // Attention wrote only the wanted rows' output; the recurrent mixers wrote every
                // token's, which are gathered too.
                let gather_proj = !matches!(layer.mixer, Mixer::Attention(_));
                self.keep_logit_rows(s, plan, gather_proj);
                n = outputs.rows(plan, n);
                if n == 0 {
                    // A chunk of a prompt: its keys and values (or states) were all it needed.
                    continue;
                }
            }
            self.residual_add_block(pool, layer.attn_post_norm.as_ref(), s, n);

            if let Some(norm) = &layer.mlp_norm {
                norm.rows(pool, &s.x[..n * h], h, d.eps, &mut s.xn[..n * h]);
            }
            match &layer.ffn {
                Ffn::Dense(mlp) => mlp.forward(&step, s, n, layer.mlp_norm.is_some()),
                Ffn::Moe(moe) => {
                    let input = if layer.mlp_norm.is_some() { &s.xn[..n * h] } else { &s.x[..n * h] };
                    moe.forward(&step, input, input, n, &mut s.proj[..n * h], &mut s.moe, &mut s.products);
                }
                Ffn::DenseAndMoe(b) => {
                    // proj = post_mlp_norm(mlp(xn)) + post_expert_norm(moe(pre_expert_norm(x))),
                    // the router reading x.
                    b.mlp.forward(&step, s, n, true);
                    b.post_mlp_norm.rows(pool, &s.proj[..n * h], h, d.eps, &mut s.moe.branch_sum[..n * h]);
                    b.pre_expert_norm.rows(pool, &s.x[..n * h], h, d.eps, &mut s.moe.branch_input[..n * h]);
                    let input = std::mem::take(&mut s.moe.branch_input);
                    b.moe.forward(
                        &step,
                        &input[..n * h],
                        &s.x[..n * h],
                        n,
                        &mut s.proj[..n * h],
                        &mut s.moe,
                        &mut s.products,
                    );
                    s.moe.branch_input = input;
                    b.post_expert_norm.rows(pool, &s.proj[..n * h], h, d.eps, &mut s.xn[..n * h]);
                    for ((p, &a), &b) in s.proj[..n * h].iter_mut().zip(&s.moe.branch_sum[..n * h]).zip(&s.xn[..n * h])
                    {
                        *p = a + b;
                    }
                }
            }
            self.residual_add_block(pool, layer.mlp_post_norm.as_ref(), s, n);

            if let Some(block) = &layer.per_layer {
                block.forward(&step, i, s, n);
                self.residual_add(pool, &mut s.x[..n * h], &s.xn[..n * h]);
            }
            if let Some(scalar) = layer.scalar {
                kernels::scale(&mut s.x[..n * h], scalar);
            }
        }

        s.last_layer_rows = n;

        // 3. Final norm and head, only for the rows whose logits are wanted; then the logit
        //    divisor and soft-cap.
        match all_logits {
            Some(out) => {
                // x (n, hidden) -> xn (n, hidden) -> out (n, vocab).
                self.final_norm.rows(pool, &s.x[..n * h], h, d.eps, &mut s.xn[..n * h]);
                self.lm_head.forward(mm, &s.xn[..n * h], n, out, &mut s.products);
                self.finish_logits(&mut out[..n * d.vocab]);
            }
            None => {
                let rows = plan.logit_rows;
                if rows == 0 {
                    return;
                }
                // Last row of each segment that wants logits (every row of a segment that wants
                // them all): x[t] (hidden) -> logit_hidden[row] (hidden), x[row] when the last
                // layer kept only those rows; then logit_hidden (rows, hidden) -> logits (rows,
                // vocab). Each row is its own product, so it does not depend on which rows
                // share the head.
                for (row, t) in plan.logit_tokens() {
                    let from = if trimmed { row } else { t };
                    self.final_norm.apply(
                        &s.x[from * h..(from + 1) * h],
                        d.eps,
                        &mut s.logit_hidden[row * h..(row + 1) * h],
                    );
                }
                self.lm_head.forward(
                    mm,
                    &s.logit_hidden[..rows * h],
                    rows,
                    &mut s.logits[..rows * d.vocab],
                    &mut s.products,
                );
                self.finish_logits(&mut s.logits[..rows * d.vocab]);
            }
        }
    }

    /// `logits / divisor` (Granite), then `cap · tanh(logits / cap)` (Gemma 2), in place.
    fn finish_logits(&self, logits: &mut [f32]) {
        if let Some(divisor) = self.logits_divisor {
            for v in logits.iter_mut() {
                *v /= divisor;
            }
        }
        if let Some(cap) = self.final_softcap {
            kernels::softcap(logits, cap);
        }
    }

    /// Moves the rows of the tokens whose logits are wanted to their logits rows (row `r` of
    /// `x`, of Gemma 4's per-layer inputs, and of `proj` when `with_proj`), for the rest of a
    /// layer that computes only those ([`Outputs::LogitRows`]). Rows are numbered in segment
    /// order, so a token's row is never after the token and the moves go front to back.
    fn keep_logit_rows(&self, s: &mut Scratch, plan: &BatchPlan, with_proj: bool) {
        let h = self.dims.hidden;
        let ple = s.ple.len() / s.max_tokens.max(1);
        for (row, t) in plan.logit_tokens() {
            debug_assert!(row <= t);
            if row == t {
                continue;
            }
            s.x.copy_within(t * h..(t + 1) * h, row * h);
            if with_proj {
                s.proj.copy_within(t * h..(t + 1) * h, row * h);
            }
            if ple > 0 {
                s.ple.copy_within(t * ple..(t + 1) * ple, row * ple);
            }
        }
    }

    /// `x += r · post_norm?(proj)` for a sub-block's output in `proj (n, hidden)`.
    fn residual_add_block(&self, pool: &ThreadPool, post_norm: Option<&Norm>, s: &mut Scratch, n: usize) {
        let h = self.dims.hidden;
        match post_norm {
            Some(norm) => {
                norm.rows(pool, &s.proj[..n * h], h, self.dims.eps, &mut s.xn[..n * h]);
                self.residual_add(pool, &mut s.x[..n * h], &s.xn[..n * h]);
            }
            None => self.residual_add(pool, &mut s.x[..n * h], &s.proj[..n * h]),
        }
    }

    /// `x += r · y` for a sub-block's output `y (rows, hidden)`: the residual add, scaled by
    /// Granite's multiplier; element by element, rows split over `pool`.
    fn residual_add(&self, pool: &ThreadPool, x: &mut [f32], y: &[f32]) {
        let h = self.dims.hidden;
        for_row_slices(pool, x, h, &|rows, x| {
            let y = &y[rows.start * h..rows.end * h];
            if self.residual_scale == 1.0 {
                kernels::add_assign(x, y);
            } else {
                kernels::add_scaled(x, y, self.residual_scale);
            }
        });
    }
}
