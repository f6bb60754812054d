//! The vision tower of a vision-language checkpoint (`*ForConditionalGeneration`): its
//! configuration (`vision_config` in `config.json`) and its tensors, bound with their exact
//! shapes as views into the maps.
//!
//! Kylin runs the towers whose blocks it implements: Qwen3.5's and Qwen3.5-MoE's
//! (`vision_config.model_type` `qwen3_5_vision` / `qwen3_5_moe_vision`): a patch embedding (a
//! 3-D convolution whose kernel equals its stride, so a matrix over each patch's
//! `channels · temporal_patch_size · patch_size²` values), a learned square table of position
//! embeddings resampled to each image's grid, pre-norm transformer blocks with 2-D rotary
//! positions and bidirectional attention, and a merger that concatenates each
//! `spatial_merge_size²` block of patches into one token of the language model's width.
//!
//! And Gemma 3's (`Gemma3ForConditionalGeneration`, `vision_config.model_type`
//! `siglip_vision_model`): a SigLIP encoder over a fixed square image (a 2-D convolution whose
//! kernel equals its stride, a learned position per patch, pre-norm blocks with separate q/k/v
//! projections and bidirectional attention, a final LayerNorm), then the multimodal projector:
//! the patches average-pooled `k × k` into `mm_tokens_per_image` tokens, a `(1 + w)` RMSNorm and
//! a matrix `(vision hidden, text hidden)` into the language model's width. SigLIP's
//! attention-pooling head is not read by Gemma 3 (reported "not run").
//!
//! And Gemma 4's (`Gemma4ForConditionalGeneration`, `vision_config.model_type` `gemma4_vision`):
//! variable resolution (an image keeps its aspect ratio within a budget of patches), a linear
//! patch embedding of pixels scaled to [-1, 1] plus one learned embedding per column and one per
//! row, blocks with RMSNorms before and after both the attention and the MLP, q/k/v norms, 2-D
//! rotary positions (a head's first half rotated by the patch's column, its second half by its
//! row), grouped-query attention with a scale of 1, a gated MLP, and linears that may clamp
//! their inputs and outputs; then `k × k` average pooling by position, a scale of `√hidden`,
//! an optional standardization, a weightless RMSNorm and the projection (`embed_vision`).
//!
//! Another tower is reported (its tensors stay "not run") and images are refused for it.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{Map, Value};

use crate::encoder::bind_one;
use crate::error::{KylinError, Result};
use crate::safetensors_file::TensorIndex;
use crate::tensor::WeightTensor;
use crate::tokenizer;

/// The `vision_config.model_type`s whose towers Kylin runs: transformers writes
/// `qwen3_5_vision`, the published Qwen3.5 checkpoints `qwen3_5` (and the MoE sizes likewise).
pub const VISION_TOWERS: &[&str] = &["qwen3_5_vision", "qwen3_5_moe_vision", "qwen3_5", "qwen3_5_moe"];

/// Gemma 3's tower: SigLIP's vision model, which Gemma 3 checkpoints name in `vision_config`.
pub const SIGLIP_TOWER: &str = "siglip_vision_model";

/// Gemma 4's tower, as Gemma 4 checkpoints name it in `vision_config`.
pub const GEMMA4_TOWER: &str = "gemma4_vision";

/// How an image's tokens attend to each other in the language model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ImageAttention {
    /// Causally, as text (Qwen3.5; Gemma 4 unless its text config says otherwise).
    Causal,
    /// In both directions within their image, on every layer (Gemma 3's `token_type_ids` mask).
    Bidirectional,
    /// In both directions within their image on the sliding-window layers only, causally on
    /// the global ones (Gemma 4 with `use_bidirectional_attention: "vision"`).
    BidirectionalOnSliding,
}

/// Which tower a [`VisionConfig`] describes, and what only that tower has.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionKind {
    /// Qwen3.5's: dynamic resolution, 2-D rotary positions, a merger of `merge²` patches.
    Qwen35,
    /// Gemma 3's SigLIP encoder and multimodal projector: a fixed `image_size` square, pooled
    /// into `tokens_per_image` tokens; image tokens attend to each other in both directions.
    Gemma3 {
        /// Side of the square image the encoder reads, in pixels (`vision_config.image_size`).
        image_size: usize,
        /// Tokens an image becomes (`mm_tokens_per_image`), a square.
        tokens_per_image: usize,
    },
    /// Gemma 4's encoder and `embed_vision`: variable resolution, `spatial_merge_size²`
    /// patches pooled into a token.
    Gemma4 {
        /// Width of a head (`head_dim`), not necessarily `hidden / heads`.
        head_dim: usize,
        /// Heads of the keys and values (grouped-query attention).
        kv_heads: usize,
        /// Entries of each axis' position table: the most patches per row or column.
        position_embedding_size: usize,
        /// Whether the pooled rows are standardized (`(x - std_bias) · std_scale`).
        standardize: bool,
        /// Whether every linear clamps its input and output (`use_clipped_linears`).
        clipped_linears: bool,
        /// How the image tokens attend in the language model.
        attention: ImageAttention,
    },
}

/// The activation of the tower's MLPs (`vision_config.hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VisionActivation {
    /// `gelu_pytorch_tanh`: PyTorch's tanh approximation.
    GeluTanh,
    /// `gelu`: the exact (erf) GELU.
    Gelu,
}

/// A Qwen3.5 vision tower's configuration, every value decided, and the prompt tokens that
/// surround and stand for an image.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct VisionConfig {
    pub model_type: String,
    pub kind: VisionKind,
    pub depth: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    /// Entries of the learned position table: a square, `side²`.
    pub num_position_embeddings: usize,
    /// The width of a merged token: the language model's hidden size.
    pub out_hidden: usize,
    pub activation: VisionActivation,
    /// The LayerNorms' epsilon (`layer_norm_eps`; Qwen's tower fixes it at 1e-6).
    pub layer_norm_eps: f64,
    /// Qwen's 2-D rotary base (unused by SigLIP, which has learned positions only).
    pub rope_theta: f64,
    /// The placeholder token that one merged image token replaces in the prompt.
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

impl VisionConfig {
    /// Values per patch row of `pixel_values`: `channels · temporal_patch_size · patch_size²`.
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    pub fn head_dim(&self) -> usize {
        match self.kind {
            VisionKind::Gemma4 { head_dim, .. } => head_dim,
            _ => self.hidden / self.heads,
        }
    }

    /// Side of the learned square position table.
    pub fn position_side(&self) -> usize {
        self.num_position_embeddings.isqrt()
    }

    /// Width of a merged block of patches: `hidden · spatial_merge_size²`.
    pub fn merged_width(&self) -> usize {
        self.hidden * self.spatial_merge_size * self.spatial_merge_size
    }

    /// How an image's tokens attend to each other in the language model.
    pub fn image_attention(&self) -> ImageAttention {
        match self.kind {
            VisionKind::Qwen35 => ImageAttention::Causal,
            VisionKind::Gemma3 { .. } => ImageAttention::Bidirectional,
            VisionKind::Gemma4 { attention, .. } => attention,
        }
    }

    /// Whether an image's tokens attend to each other in both directions on some layers (Gemma
    /// 3, and Gemma 4 with bidirectional vision), so one step must hold all of them.
    pub fn image_tokens_bidirectional(&self) -> bool {
        self.image_attention() != ImageAttention::Causal
    }
}

/// A vision tower ready to run: its configuration and its tensors by role (the checkpoint name
/// after the tower's prefix, e.g. `blocks.0.attn.qkv.weight`).
#[derive(Debug)]
pub struct LoadedVision {
    pub config: VisionConfig,
    pub tensors: BTreeMap<String, WeightTensor>,
    /// Checkpoint names of the bound tensors (so the loader does not list them as unused).
    pub names: Vec<String>,
    /// The text of the directory's `preprocessor_config.json` (how an image becomes patches),
    /// if it has one.
    pub preprocessor: Option<String>,
}

impl LoadedVision {
    /// The tensor bound for `role` (every role of the table is bound by [`bind_vision`]).
    pub fn tensor(&self, role: &str) -> Result<&WeightTensor> {
        self.tensors.get(role).ok_or_else(|| {
            KylinError::tensor_missing(format!("the vision tower has no tensor for role '{role}' (a Kylin bug)"))
        })
    }
}

fn usize_field(map: &Map<String, Value>, key: &str, default: Option<usize>, path: &Path) -> Result<usize> {
    match map.get(key) {
        None | Some(Value::Null) => default.ok_or_else(|| {
            KylinError::config_missing(format!(
                "config.json vision_config has no `{key}`, which the vision tower needs"
            ))
            .at(path)
        }),
        Some(v) => {
            v.as_u64().and_then(|n| usize::try_from(n).ok()).filter(|&n| n > 0 && n <= 1 << 20).ok_or_else(|| {
                KylinError::config_invalid(format!(
                    "config.json vision_config `{key}` must be an integer in 1..=2^20; got {v}"
                ))
                .at(path)
            })
        }
    }
}

fn token_field(map: &Map<String, Value>, key: &str, path: &Path) -> Result<u32> {
    match map.get(key) {
        Some(v) => v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| {
            KylinError::config_invalid(format!("config.json `{key}` must be a token id; got {v}")).at(path)
        }),
        None => Err(KylinError::config_missing(format!(
            "config.json has no `{key}`, which placing an image in the prompt needs"
        ))
        .at(path)),
    }
}

/// Reads `vision_config` of `dir/config.json`: `Ok(None)` when there is none, or when its
/// tower is not one Kylin runs (the caller reports that); an error names the field that is
/// wrong.
pub fn read_vision_config(dir: &Path) -> Result<Option<VisionConfig>> {
    let path = dir.join("config.json");
    let text = std::fs::read_to_string(&path).map_err(|e| KylinError::io(&path, "cannot read", &e))?;
    let top = tokenizer::parse_json_object(&text, &path)?;
    let Some(vision) = top.get("vision_config") else { return Ok(None) };
    let Value::Object(v) = vision else {
        return Err(KylinError::config_invalid(format!("config.json `vision_config` must be an object; got {vision}"))
            .at(&path));
    };
    let model_type = v.get("model_type").and_then(Value::as_str).unwrap_or_default().to_string();
    if model_type == SIGLIP_TOWER && top.get("model_type").and_then(Value::as_str) == Some("gemma3") {
        return read_gemma3(&top, v, &path).map(Some);
    }
    if model_type == GEMMA4_TOWER {
        return read_gemma4(&top, v, &path).map(Some);
    }
    if !VISION_TOWERS.contains(&model_type.as_str()) {
        return Ok(None);
    }
    // Qwen3-VL's deepstack (features of inner blocks added to early decoder layers) is not
    // Qwen3.5's: a tower that asks for it is not run.
    if v.get("deepstack_visual_indexes").and_then(Value::as_array).is_some_and(|a| !a.is_empty()) {
        return Ok(None);
    }
    let activation = activation(v, &path)?;
    let rope_theta = match v.get("rope_parameters").and_then(|p| p.get("rope_theta")) {
        None => 10_000.0,
        Some(t) => t.as_f64().filter(|t| t.is_finite() && *t > 1.0).ok_or_else(|| {
            KylinError::config_invalid(format!(
                "config.json vision_config.rope_parameters `rope_theta` must be a number above 1; got {t}"
            ))
            .at(&path)
        })?,
    };
    if let Some(kind) = v.get("rope_parameters").and_then(|p| p.get("rope_type")).and_then(Value::as_str)
        && kind != "axial"
    {
        return Err(KylinError::config_invalid(format!(
            "config.json vision_config.rope_parameters `rope_type` must be axial (2-D rotary positions); got {kind}"
        ))
        .at(&path));
    }
    let config = VisionConfig {
        model_type,
        kind: VisionKind::Qwen35,
        depth: usize_field(v, "depth", Some(27), &path)?,
        hidden: usize_field(v, "hidden_size", Some(1152), &path)?,
        intermediate: usize_field(v, "intermediate_size", Some(4304), &path)?,
        heads: usize_field(v, "num_heads", Some(16), &path)?,
        in_channels: usize_field(v, "in_channels", Some(3), &path)?,
        patch_size: usize_field(v, "patch_size", Some(16), &path)?,
        temporal_patch_size: usize_field(v, "temporal_patch_size", Some(2), &path)?,
        spatial_merge_size: usize_field(v, "spatial_merge_size", Some(2), &path)?,
        num_position_embeddings: usize_field(v, "num_position_embeddings", Some(2304), &path)?,
        out_hidden: usize_field(v, "out_hidden_size", Some(3584), &path)?,
        activation,
        layer_norm_eps: 1e-6,
        rope_theta,
        image_token_id: token_field(&top, "image_token_id", &path)?,
        vision_start_token_id: token_field(&top, "vision_start_token_id", &path)?,
        vision_end_token_id: token_field(&top, "vision_end_token_id", &path)?,
    };
    let side = config.position_side();
    let checks = [
        (config.hidden.is_multiple_of(config.heads), "hidden_size must be a multiple of num_heads"),
        (config.head_dim().is_multiple_of(4), "hidden_size / num_heads must be a multiple of 4 (2-D rotary positions)"),
        (side * side == config.num_position_embeddings, "num_position_embeddings must be a square"),
        (config.in_channels == 3, "in_channels must be 3 (RGB)"),
    ];
    if let Some((_, what)) = checks.iter().find(|(ok, _)| !ok) {
        return Err(KylinError::config_invalid(format!(
            "config.json vision_config: {what} (hidden_size {}, num_heads {}, num_position_embeddings {}, in_channels {})",
            config.hidden, config.heads, config.num_position_embeddings, config.in_channels
        ))
        .at(&path));
    }
    Ok(Some(config))
}

fn activation(v: &Map<String, Value>, path: &Path) -> Result<VisionActivation> {
    match v.get("hidden_act").and_then(Value::as_str) {
        None | Some("gelu_pytorch_tanh") => Ok(VisionActivation::GeluTanh),
        Some("gelu") => Ok(VisionActivation::Gelu),
        Some(other) => Err(KylinError::config_invalid(format!(
            "config.json vision_config `hidden_act` must be gelu_pytorch_tanh or gelu; got {other}"
        ))
        .at(path)),
    }
}

/// A token id named by either of Gemma 3's spellings (`image_token_index` in its configs,
/// `image_token_id` the alias transformers maps to it), or the default.
fn gemma_token(top: &Map<String, Value>, keys: [&str; 2], default: u32, path: &Path) -> Result<u32> {
    match keys.iter().find(|k| top.get(**k).is_some_and(|v| !v.is_null())) {
        Some(key) => token_field(top, key, path),
        None => Ok(default),
    }
}

/// Gemma 3's SigLIP tower and projector. Missing fields take Gemma 3's published values (the
/// SigLIP-So400m tower of gemma-3-4b: 27 blocks of width 1152, 16 heads, 896-pixel images in
/// patches of 14, 256 tokens per image), as transformers' `Gemma3Config` documents them.
fn read_gemma3(top: &Map<String, Value>, v: &Map<String, Value>, path: &Path) -> Result<VisionConfig> {
    let text_hidden = match top.get("text_config") {
        Some(Value::Object(t)) => usize_field(t, "hidden_size", Some(2304), path)?,
        _ => 2304,
    };
    let layer_norm_eps = match v.get("layer_norm_eps") {
        None | Some(Value::Null) => 1e-6,
        Some(e) => e.as_f64().filter(|e| e.is_finite() && *e > 0.0 && *e < 1.0).ok_or_else(|| {
            KylinError::config_invalid(format!(
                "config.json vision_config `layer_norm_eps` must be a number in (0, 1); got {e}"
            ))
            .at(path)
        })?,
    };
    let image_size = usize_field(v, "image_size", Some(896), path)?;
    let patch_size = usize_field(v, "patch_size", Some(14), path)?;
    let tokens_per_image = usize_field(top, "mm_tokens_per_image", Some(256), path)?;
    let side = image_size / patch_size;
    let tokens_side = tokens_per_image.isqrt();
    let pool = side.checked_div(tokens_side).unwrap_or(0);
    let config = VisionConfig {
        model_type: SIGLIP_TOWER.to_string(),
        kind: VisionKind::Gemma3 { image_size, tokens_per_image },
        depth: usize_field(v, "num_hidden_layers", Some(27), path)?,
        hidden: usize_field(v, "hidden_size", Some(1152), path)?,
        intermediate: usize_field(v, "intermediate_size", Some(4304), path)?,
        heads: usize_field(v, "num_attention_heads", Some(16), path)?,
        in_channels: usize_field(v, "num_channels", Some(3), path)?,
        patch_size,
        temporal_patch_size: 1,
        // The projector's pooling: `pool × pool` patches average into one token.
        spatial_merge_size: pool.max(1),
        num_position_embeddings: side * side,
        out_hidden: text_hidden,
        activation: activation(v, path)?,
        layer_norm_eps,
        rope_theta: 0.0,
        image_token_id: gemma_token(top, ["image_token_index", "image_token_id"], 262_144, path)?,
        vision_start_token_id: gemma_token(top, ["boi_token_index", "boi_token_id"], 255_999, path)?,
        vision_end_token_id: gemma_token(top, ["eoi_token_index", "eoi_token_id"], 256_000, path)?,
    };
    let checks = [
        (config.hidden.is_multiple_of(config.heads), "hidden_size must be a multiple of num_attention_heads"),
        (image_size.is_multiple_of(patch_size), "image_size must be a multiple of patch_size"),
        (side <= 1024, "image_size / patch_size must be at most 1024"),
        (tokens_side * tokens_side == tokens_per_image, "mm_tokens_per_image must be a square"),
        (pool > 0 && pool * tokens_side == side, "mm_tokens_per_image's side must divide the patches per side"),
        (config.in_channels == 3, "num_channels must be 3 (RGB)"),
    ];
    if let Some((_, what)) = checks.iter().find(|(ok, _)| !ok) {
        return Err(KylinError::config_invalid(format!(
            "config.json: {what} (vision_config hidden_size {}, num_attention_heads {}, image_size {image_size}, \
             patch_size {patch_size}, num_channels {}; mm_tokens_per_image {tokens_per_image})",
            config.hidden, config.heads, config.in_channels
        ))
        .at(path));
    }
    Ok(config)
}

/// Gemma 4's tower and `embed_vision`. Missing fields take transformers' `Gemma4VisionConfig`
/// defaults (gemma-4-e2b's tower: 16 blocks of width 768, 12 heads of 64, patches of 16 pooled
/// 3 × 3, columns and rows up to 10240 patches, a rotary base of 100).
fn read_gemma4(top: &Map<String, Value>, v: &Map<String, Value>, path: &Path) -> Result<VisionConfig> {
    let (text_hidden, attention) = match top.get("text_config") {
        Some(Value::Object(t)) => {
            let attention = match t.get("use_bidirectional_attention") {
                None | Some(Value::Null) => ImageAttention::Causal,
                Some(Value::String(s)) if s == "vision" => ImageAttention::BidirectionalOnSliding,
                Some(other) => {
                    return Err(KylinError::config_invalid(format!(
                        "config.json text_config `use_bidirectional_attention` must be null or \"vision\" for a \
                         vision-language model; got {other}"
                    ))
                    .at(path));
                }
            };
            (usize_field(t, "hidden_size", Some(2304), path)?, attention)
        }
        _ => (2304, ImageAttention::Causal),
    };
    let float = |key: &str, default: f64, min: f64, max: f64| -> Result<f64> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(e) => e.as_f64().filter(|e| e.is_finite() && *e > min && *e < max).ok_or_else(|| {
                KylinError::config_invalid(format!(
                    "config.json vision_config `{key}` must be a number in ({min}, {max}); got {e}"
                ))
                .at(path)
            }),
        }
    };
    let flag = |key: &str| -> Result<bool> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(KylinError::config_invalid(format!(
                "config.json vision_config `{key}` must be true or false; got {other}"
            ))
            .at(path)),
        }
    };
    let rope = v.get("rope_parameters").and_then(Value::as_object);
    if let Some(kind) = rope.and_then(|p| p.get("rope_type")).and_then(Value::as_str)
        && kind != "axial"
    {
        return Err(KylinError::config_invalid(format!(
            "config.json vision_config.rope_parameters `rope_type` must be axial (2-D rotary positions); got {kind}"
        ))
        .at(path));
    }
    let rope_theta = match rope.and_then(|p| p.get("rope_theta")) {
        None | Some(Value::Null) => 100.0,
        Some(t) => t.as_f64().filter(|t| t.is_finite() && *t > 1.0).ok_or_else(|| {
            KylinError::config_invalid(format!(
                "config.json vision_config.rope_parameters `rope_theta` must be a number above 1; got {t}"
            ))
            .at(path)
        })?,
    };
    let activation = match v.get("hidden_activation").or_else(|| v.get("hidden_act")).and_then(Value::as_str) {
        None | Some("gelu_pytorch_tanh") => VisionActivation::GeluTanh,
        Some(other) => {
            return Err(KylinError::config_invalid(format!(
                "config.json vision_config `hidden_activation` must be gelu_pytorch_tanh; got {other}"
            ))
            .at(path));
        }
    };
    let heads = usize_field(v, "num_attention_heads", Some(12), path)?;
    let kv_heads = usize_field(v, "num_key_value_heads", Some(heads), path)?;
    let head_dim = usize_field(v, "head_dim", Some(64), path)?;
    let position_embedding_size = usize_field(v, "position_embedding_size", Some(10_240), path)?;
    let pooling = usize_field(v, "pooling_kernel_size", Some(3), path)?;
    let config = VisionConfig {
        model_type: GEMMA4_TOWER.to_string(),
        kind: VisionKind::Gemma4 {
            head_dim,
            kv_heads,
            position_embedding_size,
            standardize: flag("standardize")?,
            clipped_linears: flag("use_clipped_linears")?,
            attention,
        },
        depth: usize_field(v, "num_hidden_layers", Some(16), path)?,
        hidden: usize_field(v, "hidden_size", Some(768), path)?,
        intermediate: usize_field(v, "intermediate_size", Some(3072), path)?,
        heads,
        in_channels: 3,
        patch_size: usize_field(v, "patch_size", Some(16), path)?,
        temporal_patch_size: 1,
        spatial_merge_size: pooling,
        num_position_embeddings: position_embedding_size,
        out_hidden: text_hidden,
        activation,
        layer_norm_eps: float("rms_norm_eps", 1e-6, 0.0, 1.0)?,
        rope_theta,
        image_token_id: gemma_token(top, ["image_token_id", "image_token_index"], 258_880, path)?,
        vision_start_token_id: gemma_token(top, ["boi_token_id", "boi_token_index"], 255_999, path)?,
        vision_end_token_id: gemma_token(top, ["eoi_token_id", "eoi_token_index"], 258_882, path)?,
    };
    let checks = [
        (heads.is_multiple_of(kv_heads), "num_attention_heads must be a multiple of num_key_value_heads"),
        (head_dim.is_multiple_of(4), "head_dim must be a multiple of 4 (2-D rotary positions)"),
        (config.patch_size <= 64, "patch_size must be at most 64"),
        (pooling <= 16, "pooling_kernel_size must be at most 16"),
    ];
    if let Some((_, what)) = checks.iter().find(|(ok, _)| !ok) {
        return Err(KylinError::config_invalid(format!(
            "config.json vision_config: {what} (num_attention_heads {heads}, num_key_value_heads {kv_heads}, \
             head_dim {head_dim}, patch_size {}, pooling_kernel_size {pooling})",
            config.patch_size
        ))
        .at(path));
    }
    Ok(config)
}

/// The linears of a Gemma 4 block, each `ClippableLinear` (the weight under `.linear`).
const GEMMA4_LINEARS: [&str; 7] = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
];

/// The clamp bounds of a clipped linear, scalars.
pub const GEMMA4_CLIP_BOUNDS: [&str; 4] = ["input_min", "input_max", "output_min", "output_max"];

/// Gemma 4's table: role (the transformers 5 name without the leading `model.`), shape.
fn gemma4_table(c: &VisionConfig) -> Vec<(String, Vec<usize>)> {
    let VisionKind::Gemma4 { head_dim, kv_heads, position_embedding_size, standardize, clipped_linears, .. } = c.kind
    else {
        return Vec::new();
    };
    let (h, i, p) = (c.hidden, c.intermediate, c.patch_size);
    let (q, kv) = (c.heads * head_dim, kv_heads * head_dim);
    let mut t = vec![
        ("vision_tower.patch_embedder.input_proj.weight".to_string(), vec![h, 3 * p * p]),
        ("vision_tower.patch_embedder.position_embedding_table".into(), vec![2, position_embedding_size, h]),
        ("embed_vision.embedding_projection.weight".into(), vec![c.out_hidden, h]),
    ];
    if standardize {
        t.push(("vision_tower.std_bias".into(), vec![h]));
        t.push(("vision_tower.std_scale".into(), vec![h]));
    }
    for l in 0..c.depth {
        let at = format!("vision_tower.encoder.layers.{l}");
        for norm in
            ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        {
            t.push((format!("{at}.{norm}.weight"), vec![h]));
        }
        t.push((format!("{at}.self_attn.q_norm.weight"), vec![head_dim]));
        t.push((format!("{at}.self_attn.k_norm.weight"), vec![head_dim]));
        for (linear, shape) in GEMMA4_LINEARS.iter().zip([[q, h], [kv, h], [kv, h], [h, q], [i, h], [i, h], [h, i]]) {
            t.push((format!("{at}.{linear}.linear.weight"), shape.to_vec()));
            if clipped_linears {
                for bound in GEMMA4_CLIP_BOUNDS {
                    t.push((format!("{at}.{linear}.{bound}"), Vec::new()));
                }
            }
        }
    }
    t
}

/// Gemma 3's table: role (the transformers 5 name without the leading `model.`), shape.
fn gemma3_table(c: &VisionConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, p) = (c.hidden, c.intermediate, c.patch_size);
    let mut t = vec![
        ("vision_tower.embeddings.patch_embedding.weight".to_string(), vec![h, c.in_channels, p, p]),
        ("vision_tower.embeddings.patch_embedding.bias".into(), vec![h]),
        ("vision_tower.embeddings.position_embedding.weight".into(), vec![c.num_position_embeddings, h]),
        ("vision_tower.post_layernorm.weight".into(), vec![h]),
        ("vision_tower.post_layernorm.bias".into(), vec![h]),
        ("multi_modal_projector.mm_soft_emb_norm.weight".into(), vec![h]),
        ("multi_modal_projector.mm_input_projection_weight".into(), vec![h, c.out_hidden]),
    ];
    for l in 0..c.depth {
        for (role, shape) in [
            ("layer_norm1.weight", vec![h]),
            ("layer_norm1.bias", vec![h]),
            ("layer_norm2.weight", vec![h]),
            ("layer_norm2.bias", vec![h]),
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.q_proj.bias", vec![h]),
            ("self_attn.k_proj.weight", vec![h, h]),
            ("self_attn.k_proj.bias", vec![h]),
            ("self_attn.v_proj.weight", vec![h, h]),
            ("self_attn.v_proj.bias", vec![h]),
            ("self_attn.out_proj.weight", vec![h, h]),
            ("self_attn.out_proj.bias", vec![h]),
            ("mlp.fc1.weight", vec![i, h]),
            ("mlp.fc1.bias", vec![i]),
            ("mlp.fc2.weight", vec![h, i]),
            ("mlp.fc2.bias", vec![h]),
        ] {
            t.push((format!("vision_tower.encoder.layers.{l}.{role}"), shape));
        }
    }
    t
}

/// Where a Gemma 3 or Gemma 4 role is stored: transformers 5 writes `model.vision_tower.…`,
/// earlier versions `vision_tower.…`, and the published Gemma 3 checkpoints
/// `vision_tower.vision_model.…` (the projector likewise with or without `model.`).
fn gemma3_name(index: &TensorIndex, role: &str) -> String {
    let inner = role.strip_prefix("vision_tower.").map(|rest| format!("vision_tower.vision_model.{rest}"));
    let mut candidates = vec![format!("model.{role}"), role.to_string()];
    if let Some(inner) = inner {
        candidates.push(format!("model.{inner}"));
        candidates.push(inner);
    }
    candidates.iter().find(|n| index.raw(n).is_some()).cloned().unwrap_or_else(|| format!("model.{role}"))
}

/// The tower's tensor table: role (the name after the prefix), shape.
fn table(c: &VisionConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, m) = (c.hidden, c.intermediate, c.merged_width());
    let mut t = vec![
        (
            "patch_embed.proj.weight".to_string(),
            vec![h, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size],
        ),
        ("patch_embed.proj.bias".into(), vec![h]),
        ("pos_embed.weight".into(), vec![c.num_position_embeddings, h]),
        ("merger.norm.weight".into(), vec![h]),
        ("merger.norm.bias".into(), vec![h]),
        ("merger.linear_fc1.weight".into(), vec![m, m]),
        ("merger.linear_fc1.bias".into(), vec![m]),
        ("merger.linear_fc2.weight".into(), vec![c.out_hidden, m]),
        ("merger.linear_fc2.bias".into(), vec![c.out_hidden]),
    ];
    for l in 0..c.depth {
        for (role, shape) in [
            ("norm1.weight", vec![h]),
            ("norm1.bias", vec![h]),
            ("norm2.weight", vec![h]),
            ("norm2.bias", vec![h]),
            ("attn.qkv.weight", vec![3 * h, h]),
            ("attn.qkv.bias", vec![3 * h]),
            ("attn.proj.weight", vec![h, h]),
            ("attn.proj.bias", vec![h]),
            ("mlp.linear_fc1.weight", vec![i, h]),
            ("mlp.linear_fc1.bias", vec![i]),
            ("mlp.linear_fc2.weight", vec![h, i]),
            ("mlp.linear_fc2.bias", vec![h]),
        ] {
            t.push((format!("blocks.{l}.{role}"), shape));
        }
    }
    t
}

/// Where the tower's tensors are: `model.visual.` (transformers 5) or `visual.` (the layout
/// the Qwen releases were first published in).
fn prefix(index: &TensorIndex) -> &'static str {
    if index.raw("visual.patch_embed.proj.weight").is_some() { "visual." } else { "model.visual." }
}

/// Binds every tensor of the tower described by `config`, each with its exact shape.
pub(crate) fn bind_vision(config: VisionConfig, index: &TensorIndex, dir: &Path) -> Result<LoadedVision> {
    let prefix = prefix(index);
    let mut tensors = BTreeMap::new();
    let mut names = Vec::new();
    let gemma = !matches!(config.kind, VisionKind::Qwen35);
    let roles = match config.kind {
        VisionKind::Qwen35 => table(&config),
        VisionKind::Gemma3 { .. } => gemma3_table(&config),
        VisionKind::Gemma4 { .. } => gemma4_table(&config),
    };
    for (role, shape) in roles {
        let name = if gemma { gemma3_name(index, &role) } else { format!("{prefix}{role}") };
        tensors.insert(role, bind_one(index, &name, &shape, dir)?);
        names.push(name);
    }
    let path = dir.join("preprocessor_config.json");
    let preprocessor = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(KylinError::io(&path, "cannot read", &e)),
    };
    Ok(LoadedVision { config, tensors, names, preprocessor })
}
