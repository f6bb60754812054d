//! The vision towers of vision-language models: from an image's patches (`pixel_values`, as
//! the image processor lays them out) to the rows that replace the image's placeholder tokens
//! in the language model's input. Three towers: Qwen3.5's and Gemma 3's (SigLIP and its
//! projector) share the pre-norm block and differ in their positions and their head; Gemma 4's
//! has its own block (RMSNorms around both halves) and head.
//!
//! Gemma 4 (`Gemma4Model.get_image_features`, eager attention): pixels scaled to [-1, 1], the
//! patch embedding (a linear over each patch's `(row in patch, column in patch, channel)`
//! values, as the image processor lays them out) plus a learned embedding of the patch's column
//! and one of its row; blocks `x += post_norm(attn(norm(x)))`, `x += post_norm(mlp(norm(x)))`
//! with RMSNorms on every query and key head (and a weightless one on every value head), 2-D
//! rotary positions (a head's first half turned by the column, its second half by the row,
//! each as rotate-half rotary over its half), grouped-query attention with a scale of 1 over the
//! whole image, and a GeGLU MLP; every linear may clamp its input and output. Then the patch
//! grid average-pooled `k × k` (raster order over the pooled grid), times `√hidden`, optionally
//! standardized, a weightless RMSNorm and the projection into the language model's width.
//!
//! Gemma 3 (`Gemma3Model.get_image_features`, eager attention): the patch embedding plus one
//! learned position per patch, pre-norm blocks with separate q/k/v projections and
//! bidirectional attention over the whole image (no rotary positions), the final LayerNorm,
//! then the projector: the patch grid average-pooled `k × k`, a `(1 + w)` RMSNorm, and the
//! matrix into the language model's width. Patch rows arrive in raster order (the convolution's
//! output order), each row `(channel, row in patch, column in patch)` as the convolution's
//! kernel is laid out ([`siglip_patches`] makes them from a channel-first image).
//!
//! Qwen3.5 guarantees:
//! - Weights are read in place from the loader's views, in their stored dtype.
//! - Compute is float32 in transformers' order of operations for `Qwen3_5VisionModel` (eager
//!   attention): patch embedding, the learned position table resampled bilinearly (corners
//!   aligned) to the image's grid, pre-norm blocks (`x + attn(LN(x))`, `x + mlp(LN(x))`) with
//!   2-D rotary positions (a patch's row on the first quarter of each head's frequencies, its
//!   column on the second) and bidirectional attention within each frame, then the merger
//!   (`fc2(gelu(fc1(LN(x) viewed as blocks of merge² patches))))`.
//! - Patches arrive in the processor's order: blocks of `merge × merge` patches, blocks in raster
//!   order; so one merged token is `merge²` consecutive rows, and merged tokens come out in
//!   raster order over the blocks, which is the order of the image's placeholder tokens.
//! - Inputs are checked before anything runs (`INPUT_INVALID` naming the numbers).

use std::sync::Arc;

use kylin_kernels::{self as kernels, ThreadPool, WeightMatrix};
use kylin_loader::vision::{LoadedVision, VisionActivation, VisionConfig, VisionKind};
use kylin_loader::{KylinError, Result};
use kylin_vision::{
    GEMMA4_SUPPORTED_SOFT_TOKENS, Gemma3ImageProcessor, Gemma4ImageProcessor, ImageLimits, QwenImageProcessor,
    VisionError, decode_image, gemma3_full_image_sequence, gemma3_image_prompt,
};

use crate::encoder::{Dense, LayerNorm, dtype_of, gelu, widened};
use crate::serving::ImageInput;

/// transformers' `nn.LayerNorm(..., eps=1e-6)` in every norm of the tower.
const NORM_EPS: f32 = 1e-6;

/// Attention rows computed at once (bounds the scores buffer: `QUERY_ROWS · frame` floats).
const QUERY_ROWS: usize = 256;

/// Patch rows of one unit of the projections or the MLP while other sequences run
/// ([`VisionTower::advance`]).
pub const UNIT_ROWS: usize = 256;

/// Multiply-adds of tower work a step runs while other sequences run: at the ~40-60 GFLOP/s
/// two AVX2 cores reach in these products, about 0.2 s (BENCHMARKS.md, "the decode gap").
pub const STEP_MACS: u64 = 4_000_000_000;

/// Multiply-adds of tower work a step runs when no other sequence runs, in units of the whole
/// image's rows: about a second, so a request that arrives meanwhile waits that long at most.
pub const ALONE_STEP_MACS: u64 = 8 * STEP_MACS;

/// Where an encoding is inside its current block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// LN and the q/k/v projections of patch rows `row..`.
    Project { row: usize },
    /// Attention of one head in the frame starting at patch `f0`, query rows `row..` (its keys
    /// and values gathered when `row` is 0).
    Attend { f0: usize, head: usize, row: usize },
    /// The output projection, LN and MLP of patch rows `row..`.
    Feed { row: usize },
}

/// An f32 buffer as a matrix of `rows` rows of `cols` for the kernels' products.
fn f32_matrix(data: &[f32], rows: usize, cols: usize) -> WeightMatrix<'_> {
    let bytes = &data[..rows * cols];
    // SAFETY: f32 has no invalid bit patterns and u8 no alignment; the view covers exactly the
    // floats' bytes and lives as long as `data`.
    let bytes = unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<u8>(), std::mem::size_of_val(bytes)) };
    WeightMatrix { dtype: kernels::WeightDType::F32, rows, cols, data: bytes }
}

/// An image's patch grid: frames, rows and columns of patches (`image_grid_thw`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
pub struct PatchGrid {
    pub t: usize,
    pub h: usize,
    pub w: usize,
}

impl PatchGrid {
    /// Patches in the grid (saturating: [`VisionTower::check`] refuses a grid this large).
    pub fn patches(&self) -> usize {
        self.t.saturating_mul(self.h).saturating_mul(self.w)
    }
}

/// A linear without bias whose input and output may be clamped (Gemma 4's `ClippableLinear`).
#[derive(Debug, Clone)]
struct ClippedLinear {
    dense: Dense,
    /// `[input_min, input_max, output_min, output_max]`, when the checkpoint clamps.
    clip: Option<[f32; 4]>,
}

impl ClippedLinear {
    /// `y (n, rows) = clamp_out(clamp_in(x (n, cols)) · Wᵀ)`; `scratch` holds the clamped
    /// input. Clamping is PyTorch's `clamp`: `min(max(v, lo), hi)`.
    fn forward(&self, pool: &ThreadPool, x: &[f32], n: usize, y: &mut [f32], scratch: &mut [f32]) {
        let Some([lo, hi, out_lo, out_hi]) = self.clip else {
            self.dense.forward_packed(pool, x, n, y);
            return;
        };
        let clamped = &mut scratch[..x.len()];
        for (c, &v) in clamped.iter_mut().zip(x) {
            *c = v.max(lo).min(hi);
        }
        self.dense.forward_packed(pool, clamped, n, y);
        for v in y.iter_mut() {
            *v = v.max(out_lo).min(out_hi);
        }
    }
}

/// Gemma 4's RMSNorm of one row in place: `x · (mean(x²) + eps)^-½`, times `weight` if given.
fn rms_norm(row: &mut [f32], weight: Option<&[f32]>, eps: f32) {
    let mean_square = (row.iter().map(|&v| f64::from(v) * f64::from(v)).sum::<f64>() / row.len() as f64) as f32;
    let inv = (mean_square + eps).powf(-0.5);
    match weight {
        Some(w) => row.iter_mut().zip(w).for_each(|(v, &w)| *v = *v * inv * w),
        None => row.iter_mut().for_each(|v| *v *= inv),
    }
}

/// A block's query, key and value projections: one fused matrix (Qwen, `(3 · hidden, hidden)`)
/// or three (SigLIP, each `(hidden, hidden)`).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
enum Qkv {
    Fused(Dense),
    Separate { q: Dense, k: Dense, v: Dense },
}

/// Where the tower's positions come from.
#[derive(Debug, Clone)]
enum Stem {
    /// Qwen3.5: the learned square table resampled to the image's grid, and 2-D rotary angles
    /// from `1 / theta^(2i / (head_dim / 2))` for `i < head_dim / 4` (the frequencies each
    /// axis uses).
    Qwen { inv_freq: Vec<f32> },
    /// SigLIP: one learned position per patch of the fixed grid, added to the patch embedding.
    Siglip,
    /// Gemma 4: a learned embedding per column and per row (the table `(2, size, hidden)`), and
    /// 2-D rotary angles from `1 / theta^(2i / (head_dim / 2))` for `i < head_dim / 4`, the
    /// column's on a head's first half and the row's on its second.
    Gemma4 { inv_freq: Vec<f32> },
}

/// What turns the last block's output into the language model's rows.
#[derive(Debug, Clone)]
enum Head {
    /// Qwen3.5's merger: LN, then each block of merge² patches `fc2(gelu(fc1(·)))`.
    Merger { norm: LayerNorm, fc1: Dense, fc2: Dense },
    /// Gemma 3: SigLIP's `post_layernorm`, then the projector: `pool × pool` average pooling,
    /// the `(1 + w)` RMSNorm (`soft_norm` holds `1 + w`) and the projection, held transposed
    /// in f32 as `(out_hidden, hidden)` for the kernels' products (the checkpoint stores it
    /// `(hidden, out_hidden)`).
    Gemma3 { post_norm: LayerNorm, soft_norm: Vec<f32>, eps: f32, projection: Vec<f32> },
    /// Gemma 4: `k × k` average pooling, `· √hidden`, `(x - bias) · scale` when the checkpoint
    /// standardizes, a weightless RMSNorm, and `embed_vision`'s projection `(out_hidden, hidden)`.
    Gemma4 { standardize: Option<(Vec<f32>, Vec<f32>)>, eps: f32, projection: Dense },
}

/// Qwen's and SigLIP's block: `x += proj(attn(LN(x)))`, `x += fc2(act(fc1(LN(x))))`.
#[derive(Debug, Clone)]
struct Block {
    norm1: LayerNorm,
    qkv: Qkv,
    proj: Dense,
    norm2: LayerNorm,
    fc1: Dense,
    fc2: Dense,
}

/// Gemma 4's block: `x += post_attention_norm(o(attn(input_norm(x))))`,
/// `x += post_feedforward_norm(down(gelu_tanh(gate(y)) · up(y)))` with
/// `y = pre_feedforward_norm(x)`; RMSNorm weights widened to f32.
#[derive(Debug, Clone)]
struct SandwichBlock {
    input_norm: Vec<f32>,
    post_attention_norm: Vec<f32>,
    pre_feedforward_norm: Vec<f32>,
    post_feedforward_norm: Vec<f32>,
    /// Per head, `(head_dim)`.
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    q: ClippedLinear,
    k: ClippedLinear,
    v: ClippedLinear,
    o: ClippedLinear,
    gate: ClippedLinear,
    up: ClippedLinear,
    down: ClippedLinear,
}

/// The tower's blocks, all of one kind.
#[derive(Debug, Clone)]
enum Blocks {
    PreNorm(Vec<Block>),
    Sandwich(Vec<SandwichBlock>),
}

impl Blocks {
    fn len(&self) -> usize {
        match self {
            Blocks::PreNorm(b) => b.len(),
            Blocks::Sandwich(b) => b.len(),
        }
    }

    /// The MLP's inner width.
    fn intermediate(&self) -> usize {
        match self {
            Blocks::PreNorm(b) => b.first().map_or(0, |b| b.fc1.rows()),
            Blocks::Sandwich(b) => b.first().map_or(0, |b| b.gate.dense.rows()),
        }
    }
}

/// An image part way through the tower ([`VisionTower::begin`], [`VisionTower::advance`]): the
/// residual stream, the rotary angles, the next block, and the blocks' work buffers.
#[derive(Debug)]
pub struct Encoding {
    grid: PatchGrid,
    /// The block being run ([`Encoding::next`]) and where in it.
    stage: Stage,
    /// The residual stream, `(patches, hidden)`.
    x: Vec<f32>,
    /// Rotary cos and sin per patch, `(patches, head_dim / 2)`.
    cos: Vec<f32>,
    sin: Vec<f32>,
    next: usize,
    xn: Vec<f32>,
    qkv: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    mid: Vec<f32>,
    keys: Vec<f32>,
    queries: Vec<f32>,
    values_t: Vec<f32>,
    probs: Vec<f32>,
    head_out: Vec<f32>,
    ones: Vec<f32>,
    /// Gemma 4's "up" half of the MLP, `(patches, intermediate)`, and the clamped inputs of its
    /// clipped linears (both empty for the other towers).
    mid_up: Vec<f32>,
    clip_in: Vec<f32>,
}

/// A vision tower (Qwen3.5's, Gemma 3's or Gemma 4's), bound to the checkpoint's tensors.
#[derive(Debug, Clone)]
pub struct VisionTower {
    config: VisionConfig,
    patch_embed: Dense,
    /// The learned position table, `(positions, hidden)` (Gemma 4: `(2 · size, hidden)`), in its
    /// stored dtype.
    pos_embed: kylin_loader::WeightTensor,
    stem: Stem,
    blocks: Blocks,
    head: Head,
    /// What the attention scores are multiplied by: `head_dim^-½`, or 1 for Gemma 4.
    attention_scale: f32,
}

impl VisionTower {
    pub fn new(loaded: &LoadedVision) -> Result<Self> {
        match loaded.config.kind {
            VisionKind::Qwen35 => Self::qwen(loaded),
            VisionKind::Gemma3 { .. } => Self::gemma3(loaded),
            VisionKind::Gemma4 { .. } => Self::gemma4(loaded),
        }
    }

    fn gemma4(loaded: &LoadedVision) -> Result<Self> {
        let c = loaded.config.clone();
        let VisionKind::Gemma4 { standardize, clipped_linears, .. } = c.kind else {
            return Err(KylinError::config_invalid("a Gemma 4 tower was asked of another config (a Kylin bug)"));
        };
        let vector = |role: &str| -> Result<Vec<f32>> { widened(loaded.tensor(role)?) };
        let linear = |role: &str| -> Result<ClippedLinear> {
            let dense = Dense::without_bias(loaded.tensor(&format!("{role}.linear.weight"))?)?;
            let clip = if clipped_linears {
                let mut bounds = [0.0f32; 4];
                for (b, name) in bounds.iter_mut().zip(kylin_loader::vision::GEMMA4_CLIP_BOUNDS) {
                    *b = vector(&format!("{role}.{name}"))?.first().copied().unwrap_or(f32::NAN);
                }
                Some(bounds)
            } else {
                None
            };
            Ok(ClippedLinear { dense, clip })
        };
        let blocks = (0..c.depth)
            .map(|l| {
                let at = format!("vision_tower.encoder.layers.{l}");
                Ok(SandwichBlock {
                    input_norm: vector(&format!("{at}.input_layernorm.weight"))?,
                    post_attention_norm: vector(&format!("{at}.post_attention_layernorm.weight"))?,
                    pre_feedforward_norm: vector(&format!("{at}.pre_feedforward_layernorm.weight"))?,
                    post_feedforward_norm: vector(&format!("{at}.post_feedforward_layernorm.weight"))?,
                    q_norm: vector(&format!("{at}.self_attn.q_norm.weight"))?,
                    k_norm: vector(&format!("{at}.self_attn.k_norm.weight"))?,
                    q: linear(&format!("{at}.self_attn.q_proj"))?,
                    k: linear(&format!("{at}.self_attn.k_proj"))?,
                    v: linear(&format!("{at}.self_attn.v_proj"))?,
                    o: linear(&format!("{at}.self_attn.o_proj"))?,
                    gate: linear(&format!("{at}.mlp.gate_proj"))?,
                    up: linear(&format!("{at}.mlp.up_proj"))?,
                    down: linear(&format!("{at}.mlp.down_proj"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let pos_embed = loaded.tensor("vision_tower.patch_embedder.position_embedding_table")?.clone();
        dtype_of(&pos_embed)?;
        let standardize = if standardize {
            Some((vector("vision_tower.std_bias")?, vector("vision_tower.std_scale")?))
        } else {
            None
        };
        let spatial = c.head_dim() / 2;
        let inv_freq =
            (0..spatial).step_by(2).map(|i| 1.0 / (c.rope_theta as f32).powf(i as f32 / spatial as f32)).collect();
        Ok(VisionTower {
            patch_embed: Dense::without_bias(loaded.tensor("vision_tower.patch_embedder.input_proj.weight")?)?,
            pos_embed,
            stem: Stem::Gemma4 { inv_freq },
            blocks: Blocks::Sandwich(blocks),
            head: Head::Gemma4 {
                standardize,
                eps: c.layer_norm_eps as f32,
                projection: Dense::without_bias(loaded.tensor("embed_vision.embedding_projection.weight")?)?,
            },
            attention_scale: 1.0,
            config: c,
        })
    }

    fn qwen(loaded: &LoadedVision) -> Result<Self> {
        let c = loaded.config.clone();
        let dense = |role: &str| -> Result<Dense> {
            Dense::new(loaded.tensor(&format!("{role}.weight"))?, loaded.tensor(&format!("{role}.bias"))?)
        };
        let norm = |role: &str| -> Result<LayerNorm> {
            LayerNorm::new(loaded.tensor(&format!("{role}.weight"))?, loaded.tensor(&format!("{role}.bias"))?, NORM_EPS)
        };
        let blocks = (0..c.depth)
            .map(|l| {
                Ok(Block {
                    norm1: norm(&format!("blocks.{l}.norm1"))?,
                    qkv: Qkv::Fused(dense(&format!("blocks.{l}.attn.qkv"))?),
                    proj: dense(&format!("blocks.{l}.attn.proj"))?,
                    norm2: norm(&format!("blocks.{l}.norm2"))?,
                    fc1: dense(&format!("blocks.{l}.mlp.linear_fc1"))?,
                    fc2: dense(&format!("blocks.{l}.mlp.linear_fc2"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let spatial = c.head_dim() / 2;
        let inv_freq =
            (0..spatial).step_by(2).map(|i| 1.0 / (c.rope_theta as f32).powf(i as f32 / spatial as f32)).collect();
        let pos_embed = loaded.tensor("pos_embed.weight")?.clone();
        dtype_of(&pos_embed)?;
        Ok(VisionTower {
            patch_embed: dense("patch_embed.proj")?,
            pos_embed,
            stem: Stem::Qwen { inv_freq },
            blocks: Blocks::PreNorm(blocks),
            attention_scale: (c.head_dim() as f32).powf(-0.5),
            head: Head::Merger {
                norm: norm("merger.norm")?,
                fc1: dense("merger.linear_fc1")?,
                fc2: dense("merger.linear_fc2")?,
            },
            config: c,
        })
    }

    fn gemma3(loaded: &LoadedVision) -> Result<Self> {
        let c = loaded.config.clone();
        let eps = c.layer_norm_eps as f32;
        let dense = |role: &str| -> Result<Dense> {
            Dense::new(loaded.tensor(&format!("{role}.weight"))?, loaded.tensor(&format!("{role}.bias"))?)
        };
        let norm = |role: &str| -> Result<LayerNorm> {
            LayerNorm::new(loaded.tensor(&format!("{role}.weight"))?, loaded.tensor(&format!("{role}.bias"))?, eps)
        };
        let blocks = (0..c.depth)
            .map(|l| {
                let at = format!("vision_tower.encoder.layers.{l}");
                Ok(Block {
                    norm1: norm(&format!("{at}.layer_norm1"))?,
                    qkv: Qkv::Separate {
                        q: dense(&format!("{at}.self_attn.q_proj"))?,
                        k: dense(&format!("{at}.self_attn.k_proj"))?,
                        v: dense(&format!("{at}.self_attn.v_proj"))?,
                    },
                    proj: dense(&format!("{at}.self_attn.out_proj"))?,
                    norm2: norm(&format!("{at}.layer_norm2"))?,
                    fc1: dense(&format!("{at}.mlp.fc1"))?,
                    fc2: dense(&format!("{at}.mlp.fc2"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let pos_embed = loaded.tensor("vision_tower.embeddings.position_embedding.weight")?.clone();
        dtype_of(&pos_embed)?;
        let (h, out) = (c.hidden, c.out_hidden);
        let soft_norm =
            widened(loaded.tensor("multi_modal_projector.mm_soft_emb_norm.weight")?)?.iter().map(|w| 1.0 + w).collect();
        // (hidden, out_hidden) as stored -> (out_hidden, hidden): one copy at load, a few MB.
        let stored = widened(loaded.tensor("multi_modal_projector.mm_input_projection_weight")?)?;
        let mut projection = vec![0.0f32; out * h];
        for (i, row) in stored.chunks_exact(out).enumerate() {
            for (o, &v) in row.iter().enumerate() {
                projection[o * h + i] = v;
            }
        }
        Ok(VisionTower {
            patch_embed: dense("vision_tower.embeddings.patch_embedding")?,
            pos_embed,
            stem: Stem::Siglip,
            blocks: Blocks::PreNorm(blocks),
            attention_scale: (c.head_dim() as f32).powf(-0.5),
            head: Head::Gemma3 { post_norm: norm("vision_tower.post_layernorm")?, soft_norm, eps, projection },
            config: c,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The language-model tokens an image of this patch grid becomes (merged `merge × merge`
    /// in Qwen's tower, pooled `pool × pool` in Gemma 3's).
    pub fn tokens(&self, grid: PatchGrid) -> usize {
        grid.patches() / (self.config.spatial_merge_size * self.config.spatial_merge_size)
    }

    /// Checks a grid and its pixel rows before anything runs.
    pub fn check(&self, pixels: &[f32], grid: PatchGrid) -> Result<()> {
        let c = &self.config;
        let m = c.spatial_merge_size;
        if let VisionKind::Gemma3 { image_size, .. } = c.kind {
            let side = image_size / c.patch_size;
            if grid != (PatchGrid { t: 1, h: side, w: side }) {
                return Err(KylinError::input_invalid(format!(
                    "Gemma 3's vision tower reads one {image_size} x {image_size} image: a grid of 1 x {side} x {side} \
                     patches; got {} x {} x {}",
                    grid.t, grid.h, grid.w
                )));
            }
        }
        if let VisionKind::Gemma4 { position_embedding_size: size, .. } = c.kind
            && (grid.t != 1 || grid.h > size || grid.w > size)
        {
            return Err(KylinError::input_invalid(format!(
                "Gemma 4's vision tower reads one image of at most {size} patches per row and column; got a grid \
                 of {} x {} x {}",
                grid.t, grid.h, grid.w
            )));
        }
        if grid.t == 0 || grid.h == 0 || grid.w == 0 || !grid.h.is_multiple_of(m) || !grid.w.is_multiple_of(m) {
            return Err(KylinError::input_invalid(format!(
                "an image's patch grid must be non-empty with rows and columns multiples of the merge size {m}; \
                 got {} x {} x {}",
                grid.t, grid.h, grid.w
            )));
        }
        let expected = grid.patches().checked_mul(c.patch_values()).filter(|_| grid.patches() < usize::MAX);
        if expected != Some(pixels.len()) {
            return Err(KylinError::input_invalid(format!(
                "an image of {} x {} x {} patches has {} pixel values per patch; expected {} values, got {}",
                grid.t,
                grid.h,
                grid.w,
                c.patch_values(),
                expected.map_or("too many".to_string(), |e| e.to_string()),
                pixels.len()
            )));
        }
        Ok(())
    }

    /// Runs the tower on one image: `pixels (patches, patch_values)` in the processor's order ->
    /// `(tokens, out_hidden)`, one row per placeholder token, in prompt order.
    pub fn encode(&self, pool: &ThreadPool, pixels: &[f32], grid: PatchGrid) -> Result<Vec<f32>> {
        let mut encoding = self.begin(pool, pixels, grid)?;
        let mut unlimited = u64::MAX;
        loop {
            if let Some(out) = self.advance(pool, &mut encoding, &mut unlimited, usize::MAX) {
                return Ok(out);
            }
        }
    }

    /// Starts encoding an image (checked first): the patch embedding, the resampled position
    /// table and the rotary angles. [`VisionTower::advance`] runs the blocks and the merger.
    pub fn begin(&self, pool: &ThreadPool, pixels: &[f32], grid: PatchGrid) -> Result<Encoding> {
        self.check(pixels, grid)?;
        let c = &self.config;
        let (n, h, hd) = (grid.patches(), c.hidden, c.head_dim());
        let frame = grid.h * grid.w;

        // 1. Patch embedding: pixels (n, patch_values) -> x (n, hidden) (Gemma 4 first maps the
        //    pixels from [0, 1] to [-1, 1]: `2 · (v - 0.5)`).
        let mut x = vec![0.0f32; n * h];
        match &self.stem {
            Stem::Gemma4 { .. } => {
                let scaled: Vec<f32> = pixels.iter().map(|&v| 2.0 * (v - 0.5)).collect();
                self.patch_embed.forward_packed(pool, &scaled, n, &mut x);
            }
            _ => self.patch_embed.forward_packed(pool, pixels, n, &mut x),
        }
        let half = hd / 2;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        match &self.stem {
            Stem::Gemma4 { inv_freq } => {
                // Patch p is at column p % w, row p / w (raster order): x += table[0][column] +
                // table[1][row]; rotary angles (n, head_dim / 2), the column's then the row's.
                let size = self.config.num_position_embeddings;
                let table = self.position_table();
                let (mut column_row, mut row_row) = (vec![0.0f32; h], vec![0.0f32; h]);
                let quarter = inv_freq.len();
                cos = vec![0.0f32; n * half];
                sin = vec![0.0f32; n * half];
                for (p, out) in x.chunks_exact_mut(h).enumerate() {
                    let (column, row) = (p % grid.w, p / grid.w);
                    kernels::widen_row(table, column, &mut column_row);
                    kernels::widen_row(table, size + row, &mut row_row);
                    for ((o, &a), &b) in out.iter_mut().zip(&column_row).zip(&row_row) {
                        *o += a + b;
                    }
                    for i in 0..half {
                        let (axis, f) = if i < quarter { (column, i) } else { (row, i - quarter) };
                        let angle = axis as f32 * inv_freq[f];
                        cos[p * half + i] = angle.cos();
                        sin[p * half + i] = angle.sin();
                    }
                }
            }
            Stem::Siglip => {
                // Patch p takes row p of the position table.
                let table = self.position_table();
                let mut row = vec![0.0f32; h];
                for (p, out) in x.chunks_exact_mut(h).enumerate() {
                    kernels::widen_row(table, p, &mut row);
                    kernels::add_assign(out, &row);
                }
            }
            Stem::Qwen { inv_freq } => {
                // Each patch's (row, column) in its frame, from the processor's block order; the
                // position table resampled to the grid.
                let places: Vec<(usize, usize)> = (0..n).map(|p| self.place(p % frame, grid.w)).collect();
                self.add_positions(&places, grid, &mut x);
                // 2. 2-D rotary angles per patch, (n, head_dim / 2): the row on the first quarter
                //    of the frequencies, the column on the second.
                let quarter = inv_freq.len();
                cos = vec![0.0f32; n * half];
                sin = vec![0.0f32; n * half];
                for (p, &(row, col)) in places.iter().enumerate() {
                    for i in 0..half {
                        let (axis, f) = if i < quarter { (row, i) } else { (col, i - quarter) };
                        let angle = axis as f32 * inv_freq[f];
                        cos[p * half + i] = angle.cos();
                        sin[p * half + i] = angle.sin();
                    }
                }
            }
        }
        let inter = self.blocks.intermediate();
        let rows = QUERY_ROWS.min(frame);
        let (q_width, kv_width) = self.attention_widths();
        let sandwich = matches!(self.blocks, Blocks::Sandwich(_));
        Ok(Encoding {
            grid,
            stage: Stage::Project { row: 0 },
            x,
            cos,
            sin,
            next: 0,
            xn: vec![0.0; n * h],
            qkv: vec![0.0; n * (q_width + 2 * kv_width)],
            attn: vec![0.0; n * q_width],
            proj: vec![0.0; n * h],
            mid: vec![0.0; n * inter],
            keys: vec![0.0; frame * hd],
            queries: vec![0.0; frame * hd],
            values_t: vec![0.0; hd * frame],
            probs: vec![0.0; rows * frame],
            head_out: vec![0.0; rows * hd],
            ones: vec![1.0; inter],
            mid_up: if sandwich { vec![0.0; n * inter] } else { Vec::new() },
            clip_in: if sandwich { vec![0.0; n * inter.max(h).max(q_width)] } else { Vec::new() },
        })
    }

    /// Runs units of an encoding's blocks (at least one) until `budget` multiply-adds are
    /// spent (it is decreased by what they took); once every block ran, the head too, and
    /// gives the tower's output `(tokens, out_hidden)`. The projections and the MLP take
    /// `unit_rows` patch rows per unit ([`UNIT_ROWS`] beside running sequences; more rows read
    /// each weight once for more of them, which is faster when nothing waits).
    pub fn advance(&self, pool: &ThreadPool, e: &mut Encoding, budget: &mut u64, unit_rows: usize) -> Option<Vec<f32>> {
        loop {
            if e.next == self.blocks.len() {
                break;
            }
            *budget = budget.saturating_sub(self.run_unit(pool, e, unit_rows.max(1)));
            if *budget == 0 {
                break;
            }
        }
        if e.next < self.blocks.len() {
            return None;
        }
        let c = &self.config;
        let tokens = self.tokens(e.grid);
        let mut out = vec![0.0f32; tokens * c.out_hidden];
        match &self.head {
            Head::Merger { norm, fc1, fc2 } => {
                // 4. The merger: LN per patch, then each block of merge² patches as one row
                //    (tokens, merged_width) -> fc1 (tokens, merged_width) -> gelu -> fc2
                //    (tokens, out).
                norm.rows(&mut e.x);
                let mut merged = vec![0.0f32; tokens * c.merged_width()];
                fc1.forward_packed(pool, &e.x, tokens, &mut merged);
                gelu(&mut merged);
                fc2.forward_packed(pool, &merged, tokens, &mut out);
            }
            Head::Gemma3 { post_norm, soft_norm, eps, projection } => {
                // 4. LN per patch; the (side, side) grid averaged over pool × pool windows into
                //    (tokens, hidden), raster order; RMSNorm · (1 + w); then
                //    (tokens, hidden) · projectionᵀ (out_hidden, hidden) -> (tokens, out_hidden).
                post_norm.rows(&mut e.x);
                let h = c.hidden;
                let mut pooled = average_pool(&e.x, e.grid, c.spatial_merge_size, h);
                for row in pooled.chunks_exact_mut(h) {
                    let mean_square = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
                    let inv = 1.0 / (mean_square + eps).sqrt();
                    for (v, w) in row.iter_mut().zip(soft_norm) {
                        *v = *v * inv * w;
                    }
                }
                kernels::gemm_packed(pool, f32_matrix(projection, c.out_hidden, h), &pooled, tokens, &mut out);
            }
            Head::Gemma4 { standardize, eps, projection } => {
                // 4. The (h, w) grid averaged over k × k windows into (tokens, hidden), raster
                //    order over the pooled grid; · √hidden; standardized; the weightless RMSNorm;
                //    then (tokens, hidden) · projectionᵀ (hidden, out_hidden) -> (tokens, out).
                let h = c.hidden;
                let mut pooled = average_pool(&e.x, e.grid, c.spatial_merge_size, h);
                let root = (h as f64).sqrt() as f32;
                for row in pooled.chunks_exact_mut(h) {
                    kernels::scale(row, root);
                    if let Some((bias, scale)) = standardize {
                        for ((v, &b), &s) in row.iter_mut().zip(bias).zip(scale) {
                            *v = (*v - b) * s;
                        }
                    }
                    rms_norm(row, None, *eps);
                }
                projection.forward_packed(pool, &pooled, tokens, &mut out);
            }
        }
        Some(out)
    }

    /// The learned position table as a matrix `(positions, hidden)`.
    fn position_table(&self) -> WeightMatrix<'_> {
        let tables = if matches!(self.stem, Stem::Gemma4 { .. }) { 2 } else { 1 };
        WeightMatrix {
            dtype: dtype_of(&self.pos_embed).unwrap_or(kernels::WeightDType::F32),
            rows: tables * self.config.num_position_embeddings,
            cols: self.config.hidden,
            data: self.pos_embed.bytes(),
        }
    }

    /// The widths of a token's queries (`heads · head_dim`) and of its keys and values
    /// (`kv_heads · head_dim`; both `hidden` in Qwen's and SigLIP's towers).
    fn attention_widths(&self) -> (usize, usize) {
        let c = &self.config;
        match c.kind {
            VisionKind::Gemma4 { head_dim, kv_heads, .. } => (c.heads * head_dim, kv_heads * head_dim),
            _ => (c.hidden, c.hidden),
        }
    }

    /// Where token `j`'s query, key and value start in `qkv` (add `j * stride + head * hd`),
    /// and their strides: side by side per token (Qwen's fused projection, `(n, 3h)`) or one
    /// after the other (SigLIP's and Gemma 4's three: `(n, q)`, then `(n, kv)` twice).
    fn qkv_layout(&self, n: usize) -> ([usize; 3], [usize; 3]) {
        let h = self.config.hidden;
        let (q, kv) = self.attention_widths();
        match &self.blocks {
            Blocks::PreNorm(b) if matches!(b.first().map(|b| &b.qkv), Some(Qkv::Fused(_))) => {
                ([0, h, 2 * h], [3 * h; 3])
            }
            _ => ([0, n * q, n * (q + kv)], [q, kv, kv]),
        }
    }

    /// 3\. One unit of the current block's work, then the next stage; returns the
    /// multiply-adds it took. A block (`x += attn(LN(x))`, `x += mlp(LN(x))`) is cut into units
    /// that each read every weight of their part once: the projections of [`UNIT_ROWS`] patch
    /// rows, the attention of one head over [`QUERY_ROWS`] queries, the output projection and
    /// MLP of [`UNIT_ROWS`] rows. Every row's arithmetic is the same whatever the cut.
    fn run_unit(&self, pool: &ThreadPool, e: &mut Encoding, unit_rows: usize) -> u64 {
        let c = &self.config;
        let (n, h, hd, heads) = (e.grid.patches(), c.hidden, c.head_dim(), c.heads);
        let (frame, half, inter) = (e.grid.h * e.grid.w, hd / 2, e.ones.len());
        let (q_width, kv_width) = self.attention_widths();
        let group = q_width / kv_width;
        let ([at_q, at_k, at_v], [stride_q, stride_k, stride_v]) = self.qkv_layout(n);
        match e.stage {
            Stage::Project { row } => {
                let (r0, r1) = (row, row.saturating_add(unit_rows).min(n));
                let m = r1 - r0;
                e.xn[r0 * h..r1 * h].copy_from_slice(&e.x[r0 * h..r1 * h]);
                match &self.blocks {
                    Blocks::PreNorm(blocks) => {
                        // x rows (m, h) -> LN -> q, k, v rows; rotary on q and k (Qwen).
                        let block = &blocks[e.next];
                        block.norm1.rows(&mut e.xn[r0 * h..r1 * h]);
                        let xn = &e.xn[r0 * h..r1 * h];
                        match &block.qkv {
                            Qkv::Fused(qkv) => {
                                // (m, h) -> (m, 3h).
                                qkv.forward_packed(pool, xn, m, &mut e.qkv[r0 * 3 * h..r1 * 3 * h]);
                                if !e.cos.is_empty() {
                                    for p in r0..r1 {
                                        let (c_p, s_p) =
                                            (&e.cos[p * half..(p + 1) * half], &e.sin[p * half..(p + 1) * half]);
                                        for head in e.qkv[p * 3 * h..p * 3 * h + 2 * h].chunks_exact_mut(hd) {
                                            kernels::rope_rotate_half(head, c_p, s_p);
                                        }
                                    }
                                }
                            }
                            Qkv::Separate { q, k, v } => {
                                // (m, h) -> three (m, h), into their parts of qkv (3, n, h).
                                for (dense, at) in [(q, at_q), (k, at_k), (v, at_v)] {
                                    dense.forward_packed(pool, xn, m, &mut e.qkv[at + r0 * h..at + r1 * h]);
                                }
                            }
                        }
                    }
                    Blocks::Sandwich(blocks) => {
                        // x rows (m, h) -> RMSNorm -> q (m, q_width), k and v (m, kv_width);
                        // every head RMS-normed (v without weight), q and k turned by the 2-D
                        // rotary angles: the first half of a head by the column's, the second
                        // by the row's.
                        let block = &blocks[e.next];
                        for row in e.xn[r0 * h..r1 * h].chunks_exact_mut(h) {
                            rms_norm(row, Some(&block.input_norm), c.layer_norm_eps as f32);
                        }
                        let xn = &e.xn[r0 * h..r1 * h];
                        for (linear, at, width) in
                            [(&block.q, at_q, q_width), (&block.k, at_k, kv_width), (&block.v, at_v, kv_width)]
                        {
                            linear.forward(pool, xn, m, &mut e.qkv[at + r0 * width..at + r1 * width], &mut e.clip_in);
                        }
                        let eps = c.layer_norm_eps as f32;
                        let quarter = half / 2;
                        for p in r0..r1 {
                            let (c_p, s_p) = (&e.cos[p * half..(p + 1) * half], &e.sin[p * half..(p + 1) * half]);
                            for (at, width, norm) in
                                [(at_q, q_width, Some(&block.q_norm)), (at_k, kv_width, Some(&block.k_norm))]
                            {
                                for head in e.qkv[at + p * width..at + (p + 1) * width].chunks_exact_mut(hd) {
                                    rms_norm(head, norm.map(Vec::as_slice), eps);
                                    let (first, second) = head.split_at_mut(half);
                                    kernels::rope_rotate_half(first, &c_p[..quarter], &s_p[..quarter]);
                                    kernels::rope_rotate_half(second, &c_p[quarter..], &s_p[quarter..]);
                                }
                            }
                            for head in e.qkv[at_v + p * kv_width..at_v + (p + 1) * kv_width].chunks_exact_mut(hd) {
                                rms_norm(head, None, eps);
                            }
                        }
                    }
                }
                e.stage = if r1 == n { Stage::Attend { f0: 0, head: 0, row: 0 } } else { Stage::Project { row: r1 } };
                (m * h * (q_width + 2 * kv_width)) as u64
            }
            Stage::Attend { f0, head, row } => {
                // Bidirectional attention within each frame, per head, as matrix products:
                // scores (rows, frame) = Q (rows, hd) · Kᵀ, times the scale, softmax per row,
                // then out (rows, hd) = P (rows, frame) · V, queries taken QUERY_ROWS at a time
                // so the scores stay small whatever the image. Query head `head` reads key and
                // value head `head / group`.
                if row == 0 {
                    let kv_head = head / group;
                    for j in 0..frame {
                        let (q, k, v) = (
                            at_q + (f0 + j) * stride_q + head * hd,
                            at_k + (f0 + j) * stride_k + kv_head * hd,
                            at_v + (f0 + j) * stride_v + kv_head * hd,
                        );
                        e.keys[j * hd..(j + 1) * hd].copy_from_slice(&e.qkv[k..k + hd]);
                        e.queries[j * hd..(j + 1) * hd].copy_from_slice(&e.qkv[q..q + hd]);
                        for d in 0..hd {
                            e.values_t[d * frame + j] = e.qkv[v + d];
                        }
                    }
                }
                let k = f32_matrix(&e.keys, frame, hd);
                let v_t = f32_matrix(&e.values_t, hd, frame);
                let rows = QUERY_ROWS.min(frame - row);
                let p = &mut e.probs[..rows * frame];
                kernels::gemm_packed(pool, k, &e.queries[row * hd..(row + rows) * hd], rows, p);
                for r in p.chunks_exact_mut(frame) {
                    if self.attention_scale != 1.0 {
                        kernels::scale(r, self.attention_scale);
                    }
                    kernels::softmax(r);
                }
                kernels::gemm_packed(pool, v_t, p, rows, &mut e.head_out[..rows * hd]);
                for (i, o) in e.head_out[..rows * hd].chunks_exact(hd).enumerate() {
                    let at = (f0 + row + i) * q_width + head * hd;
                    e.attn[at..at + hd].copy_from_slice(o);
                }
                e.stage = match (row + rows < frame, head + 1 < heads, f0 + frame < n) {
                    (true, _, _) => Stage::Attend { f0, head, row: row + rows },
                    (false, true, _) => Stage::Attend { f0, head: head + 1, row: 0 },
                    (false, false, true) => Stage::Attend { f0: f0 + frame, head: 0, row: 0 },
                    (false, false, false) => Stage::Feed { row: 0 },
                };
                (2 * rows * frame * hd) as u64
            }
            Stage::Feed { row } => {
                let (r0, r1) = (row, row.saturating_add(unit_rows).min(n));
                let m = r1 - r0;
                let (x, proj) = (&mut e.x[r0 * h..r1 * h], &mut e.proj[r0 * h..r1 * h]);
                let attn = &e.attn[r0 * q_width..r1 * q_width];
                let xn = &mut e.xn[r0 * h..r1 * h];
                let mid = &mut e.mid[r0 * inter..r1 * inter];
                match &self.blocks {
                    Blocks::PreNorm(blocks) => {
                        let block = &blocks[e.next];
                        // attn rows (m, h) -> proj (m, h); x += proj.
                        block.proj.forward_packed(pool, attn, m, proj);
                        kernels::add_assign(x, proj);
                        // x -> LN -> fc1 (m, inter) -> act -> fc2 (m, h); x += that.
                        xn.copy_from_slice(x);
                        block.norm2.rows(xn);
                        block.fc1.forward_packed(pool, xn, m, mid);
                        match c.activation {
                            // The kernels' GeGLU with an "up" of ones: gelu_tanh(x) · 1.
                            VisionActivation::GeluTanh => {
                                mid.chunks_exact_mut(inter).for_each(|r| kernels::gelu_tanh_mul(r, &e.ones))
                            }
                            VisionActivation::Gelu => gelu(mid),
                        }
                        block.fc2.forward_packed(pool, mid, m, proj);
                        kernels::add_assign(x, proj);
                    }
                    Blocks::Sandwich(blocks) => {
                        let block = &blocks[e.next];
                        let eps = c.layer_norm_eps as f32;
                        // attn rows (m, q_width) -> o (m, h) -> RMSNorm; x += that.
                        block.o.forward(pool, attn, m, proj, &mut e.clip_in);
                        for r in proj.chunks_exact_mut(h) {
                            rms_norm(r, Some(&block.post_attention_norm), eps);
                        }
                        kernels::add_assign(x, proj);
                        // x -> RMSNorm -> gate, up (m, inter) -> gelu_tanh(gate) · up -> down
                        // (m, h) -> RMSNorm; x += that.
                        xn.copy_from_slice(x);
                        for r in xn.chunks_exact_mut(h) {
                            rms_norm(r, Some(&block.pre_feedforward_norm), eps);
                        }
                        let up = &mut e.mid_up[r0 * inter..r1 * inter];
                        block.gate.forward(pool, xn, m, mid, &mut e.clip_in);
                        block.up.forward(pool, xn, m, up, &mut e.clip_in);
                        for (g, u) in mid.chunks_exact_mut(inter).zip(up.chunks_exact(inter)) {
                            kernels::gelu_tanh_mul(g, u);
                        }
                        block.down.forward(pool, mid, m, proj, &mut e.clip_in);
                        for r in proj.chunks_exact_mut(h) {
                            rms_norm(r, Some(&block.post_feedforward_norm), eps);
                        }
                        kernels::add_assign(x, proj);
                    }
                }
                if r1 == n {
                    e.next += 1;
                    e.stage = Stage::Project { row: 0 };
                } else {
                    e.stage = Stage::Feed { row: r1 };
                }
                let gates = if matches!(self.blocks, Blocks::Sandwich(_)) { 3 } else { 2 };
                (m * (q_width * h + gates * h * inter)) as u64
            }
        }
    }

    /// A patch's (row, column) in its frame from its index `p` in the processor's order:
    /// (block row, block column, row in block, column in block).
    fn place(&self, p: usize, grid_w: usize) -> (usize, usize) {
        let m = self.config.spatial_merge_size;
        let blocks_w = grid_w / m;
        let (in_col, in_row) = (p % m, (p / m) % m);
        let (block_col, block_row) = ((p / (m * m)) % blocks_w, p / (m * m * blocks_w));
        (block_row * m + in_row, block_col * m + in_col)
    }

    /// `x += ` the position table resampled to the grid: bilinear, corners aligned, as
    /// transformers' `get_vision_interpolation_indices_and_weights` gives it (two taps per
    /// axis, clamped to the table's edge).
    fn add_positions(&self, places: &[(usize, usize)], grid: PatchGrid, x: &mut [f32]) {
        let h = self.config.hidden;
        let side = self.config.position_side();
        let table = self.position_table();
        let taps = |index: usize, size: usize| -> [(usize, f32); 2] {
            let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
            let floor = src.floor();
            [0usize, 1].map(|off| {
                let tap = (floor as usize + off).min(side - 1);
                let weight = (1.0 - (src - floor - off as f32).abs()).max(0.0);
                (tap, weight)
            })
        };
        let mut sum = vec![0.0f32; h];
        let mut row_values = vec![0.0f32; h];
        for (&(row, col), out) in places.iter().zip(x.chunks_exact_mut(h)) {
            sum.fill(0.0);
            for (tap_h, weight_h) in taps(row, grid.h) {
                for (tap_w, weight_w) in taps(col, grid.w) {
                    let weight = weight_h * weight_w;
                    kernels::widen_row(table, tap_h * side + tap_w, &mut row_values);
                    for (s, &v) in sum.iter_mut().zip(&row_values) {
                        *s += v * weight;
                    }
                }
            }
            kernels::add_assign(out, &sum);
        }
    }
}

/// The patch grid of `x (h · w, hidden)` in raster order averaged over `k × k` windows:
/// `(h / k · w / k, hidden)`, raster order over the pooled grid.
fn average_pool(x: &[f32], grid: PatchGrid, k: usize, hidden: usize) -> Vec<f32> {
    let per_row = grid.w / k;
    let tokens = (grid.h / k) * per_row;
    let mut pooled = vec![0.0f32; tokens * hidden];
    for (t, row) in pooled.chunks_exact_mut(hidden).enumerate() {
        let (ty, tx) = (t / per_row, t % per_row);
        for dy in 0..k {
            for dx in 0..k {
                let p = (ty * k + dy) * grid.w + tx * k + dx;
                kernels::add_assign(row, &x[p * hidden..(p + 1) * hidden]);
            }
        }
        kernels::scale(row, 1.0 / (k * k) as f32);
    }
    pooled
}

/// A channel-first image `(3, size, size)` as SigLIP's convolution reads it: one row per patch in
/// raster order, `(patches, 3 · patch²)`, each row `(channel, row in patch, column in patch)`.
/// `None` when the values do not make such an image.
pub fn siglip_patches(pixels: &[f32], size: usize, patch: usize) -> Option<Vec<f32>> {
    if patch == 0 || !size.is_multiple_of(patch) || Some(pixels.len()) != size.checked_mul(size)?.checked_mul(3) {
        return None;
    }
    let side = size / patch;
    let mut out = Vec::with_capacity(pixels.len());
    for py in 0..side {
        for px in 0..side {
            for c in 0..3 {
                for dy in 0..patch {
                    let at = (c * size + py * patch + dy) * size + px * patch;
                    out.extend_from_slice(&pixels[at..at + patch]);
                }
            }
        }
    }
    Some(out)
}

/// From an image file's bytes to a request's [`ImageInput`], as the checkpoint's
/// `preprocessor_config.json` says, and the prompt's image placeholders expanded to the tokens
/// each image becomes. Cheap to share: the server's handlers prepare images on their own
/// threads, not the engine's.
#[derive(Debug, Clone)]
pub struct ImagePreparer {
    processor: Processor,
    limits: ImageLimits,
    image_token_id: u32,
}

#[derive(Debug, Clone)]
enum Processor {
    /// transformers' Qwen2-VL image processor: dynamic resolution; an image's placeholder
    /// token is repeated once per merged token.
    Qwen(QwenImageProcessor),
    /// transformers' Gemma 3 image processor: one square of the tower's size, pan-and-scan
    /// off as `Gemma3Processor` calls it; each `<start_of_image>` of the prompt becomes
    /// `"\n\n<start_of_image>" + <image_soft_token> × tokens + "<end_of_image>\n\n"`.
    Gemma3 {
        processor: Gemma3ImageProcessor,
        patch: usize,
        tokens: usize,
        boi: u32,
        eoi: u32,
        /// The begin-of-image token's text and what the processor puts in its place, when the
        /// model has a tokenizer that names the three tokens.
        text: Option<(String, String)>,
    },
    /// transformers' Gemma 4 image processor: the image keeps its aspect ratio within a budget
    /// of patches; each image token of the prompt (the chat template's placeholder) becomes
    /// `boi + image token × tokens + eoi`, as `Gemma4Processor` expands it.
    Gemma4 { processor: Gemma4ImageProcessor, boi: u32, eoi: u32 },
}

/// A request's settings of the image processor, over what `preprocessor_config.json` says
/// (vLLM's `mm_processor_kwargs`). Each applies to the models whose processor reads it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ImageOptions {
    /// Qwen: the fewest and the most pixels an image is resized to (`min_pixels`,
    /// `max_pixels`).
    pub min_pixels: Option<u64>,
    pub max_pixels: Option<u64>,
    /// Gemma 4: the most tokens an image becomes (`max_soft_tokens`: 70, 140, 280, 560 or 1120).
    pub max_soft_tokens: Option<usize>,
    /// Gemma 3: whether an elongated image is also given as crops (`do_pan_and_scan`, off as
    /// `Gemma3Processor` calls its image processor).
    pub do_pan_and_scan: Option<bool>,
}

/// A value of `mm_processor_kwargs` Kylin cannot take: the key (`mm_processor_kwargs.KEY`),
/// what is wrong, and whether the key is one Kylin does not know at all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageOptionError {
    pub at: String,
    pub message: String,
    pub unknown_key: bool,
}

impl ImageOptions {
    /// Reads `mm_processor_kwargs` (vLLM's name): `min_pixels` and `max_pixels` (Qwen's
    /// processor), `do_pan_and_scan` (Gemma 3's, a boolean), `max_soft_tokens` (Gemma 4's); the
    /// numbers positive integers. Whether the model's processor reads them is checked with the
    /// model ([`ImagePreparer::with_options`]).
    pub fn from_json(
        value: &serde_json::Map<String, serde_json::Value>,
    ) -> std::result::Result<Self, ImageOptionError> {
        let mut options = ImageOptions::default();
        for (key, v) in value {
            let at = format!("mm_processor_kwargs.{key}");
            let wrong = |what: &str| ImageOptionError {
                at: at.clone(),
                message: format!("`{at}` must be {what}; got {v}"),
                unknown_key: false,
            };
            let number = || v.as_u64().filter(|&n| n > 0).ok_or_else(|| wrong("a positive integer"));
            match key.as_str() {
                "min_pixels" => options.min_pixels = Some(number()?),
                "max_pixels" => options.max_pixels = Some(number()?),
                "max_soft_tokens" => {
                    options.max_soft_tokens = Some(usize::try_from(number()?).map_err(|_| wrong("a smaller integer"))?)
                }
                "do_pan_and_scan" => options.do_pan_and_scan = Some(v.as_bool().ok_or_else(|| wrong("true or false"))?),
                _ => {
                    return Err(ImageOptionError {
                        message: format!(
                            "`{key}` is not an image processor setting Kylin reads: min_pixels and max_pixels \
                             (Qwen), do_pan_and_scan (Gemma 3), max_soft_tokens (Gemma 4)"
                        ),
                        at,
                        unknown_key: true,
                    });
                }
            }
        }
        Ok(options)
    }

    /// The keys these options set, by their `mm_processor_kwargs` names.
    pub fn keys(&self) -> impl Iterator<Item = &'static str> + '_ {
        [
            ("min_pixels", self.min_pixels.is_some()),
            ("max_pixels", self.max_pixels.is_some()),
            ("max_soft_tokens", self.max_soft_tokens.is_some()),
            ("do_pan_and_scan", self.do_pan_and_scan.is_some()),
        ]
        .into_iter()
        .filter_map(|(key, set)| set.then_some(key))
    }

    /// These options, each unset one taken from `defaults` (a server's `--mm-processor-kwargs`).
    pub fn or(self, defaults: &ImageOptions) -> ImageOptions {
        ImageOptions {
            min_pixels: self.min_pixels.or(defaults.min_pixels),
            max_pixels: self.max_pixels.or(defaults.max_pixels),
            max_soft_tokens: self.max_soft_tokens.or(defaults.max_soft_tokens),
            do_pan_and_scan: self.do_pan_and_scan.or(defaults.do_pan_and_scan),
        }
    }
}

/// The most pixels a request may ask Qwen's processor to resize an image to (`max_pixels`):
/// 16 megapixels, 16 times Qwen3.5's published maximum.
const MAX_REQUEST_PIXELS: u64 = 1 << 24;

/// A refused image as Kylin's error: `IMAGE_INVALID`, the decoder's own code first.
fn image_error(e: VisionError) -> KylinError {
    KylinError::image_invalid(format!("{}: {}", e.code(), e.message))
}

impl ImagePreparer {
    /// The preparer of a tower's images: `None` without a `preprocessor_config.json` (then
    /// only images given as patches run), `CONFIG_INVALID` when it is malformed or disagrees
    /// with the tower (patch, frame or merge size; Gemma 3's image size). `token_text` gives a
    /// token's text (for Gemma 3's expansion of its image marker in the prompt's text).
    pub fn new(loaded: &LoadedVision, token_text: &dyn Fn(u32) -> Option<String>) -> Result<Option<Self>> {
        let Some(text) = loaded.preprocessor.as_deref() else { return Ok(None) };
        let c = &loaded.config;
        let invalid = |e: VisionError| KylinError::config_invalid(format!("preprocessor_config.json: {}", e.message));
        let processor = match c.kind {
            VisionKind::Gemma4 { .. } => {
                let processor = Gemma4ImageProcessor::from_json(text).map_err(invalid)?;
                let pairs = [
                    ("patch_size", processor.patch_size, c.patch_size),
                    ("pooling_kernel_size", processor.pooling_kernel_size, c.spatial_merge_size),
                ];
                if let Some((name, got, want)) = pairs.into_iter().find(|(_, got, want)| got != want) {
                    return Err(KylinError::config_invalid(format!(
                        "preprocessor_config.json {name} is {got}, but the vision tower (config.json vision_config) takes {want}"
                    )));
                }
                Processor::Gemma4 { processor, boi: c.vision_start_token_id, eoi: c.vision_end_token_id }
            }
            VisionKind::Qwen35 => {
                let processor = QwenImageProcessor::from_json(text).map_err(invalid)?;
                let pairs = [
                    ("patch_size", processor.patch_size, c.patch_size),
                    ("temporal_patch_size", processor.temporal_patch_size, c.temporal_patch_size),
                    ("merge_size", processor.merge_size, c.spatial_merge_size),
                ];
                if let Some((name, got, want)) = pairs.into_iter().find(|(_, got, want)| got != want) {
                    return Err(KylinError::config_invalid(format!(
                        "preprocessor_config.json {name} is {got}, but the vision tower (config.json vision_config) takes {want}"
                    )));
                }
                Processor::Qwen(processor)
            }
            VisionKind::Gemma3 { image_size, tokens_per_image } => {
                let mut processor = Gemma3ImageProcessor::from_json(text).map_err(invalid)?;
                if (processor.height, processor.width) != (image_size, image_size) || !processor.do_resize {
                    return Err(KylinError::config_invalid(format!(
                        "preprocessor_config.json resizes images to {} x {}{}, but the vision tower \
                         (config.json vision_config.image_size) reads {image_size} x {image_size}",
                        processor.height,
                        processor.width,
                        if processor.do_resize { "" } else { " (do_resize is false)" }
                    )));
                }
                // Gemma3Processor calls its image processor with pan-and-scan off, whatever the
                // file says; Kylin answers as transformers does.
                processor.do_pan_and_scan = false;
                let names = [c.vision_start_token_id, c.image_token_id, c.vision_end_token_id].map(token_text);
                let text = match names {
                    [Some(boi), Some(image), Some(eoi)] => {
                        let full = gemma3_full_image_sequence(&boi, &image, &eoi, tokens_per_image);
                        Some((boi, full))
                    }
                    _ => None,
                };
                Processor::Gemma3 {
                    processor,
                    patch: c.patch_size,
                    tokens: tokens_per_image,
                    boi: c.vision_start_token_id,
                    eoi: c.vision_end_token_id,
                    text,
                }
            }
        };
        Ok(Some(ImagePreparer { processor, limits: ImageLimits::default(), image_token_id: c.image_token_id }))
    }

    /// The largest encoded image it accepts, in bytes.
    pub fn max_bytes(&self) -> usize {
        self.limits.max_bytes
    }

    /// Decodes a PNG, JPEG or WebP file and makes its patches (`IMAGE_INVALID` naming what is
    /// wrong with it): the whole image, as the directory's processor settings say (Gemma 3's
    /// pan-and-scan crops, which only a request asks for, come from
    /// [`ImagePreparer::prepare_all`]).
    pub fn prepare(&self, bytes: &[u8]) -> Result<ImageInput> {
        let mut all = self.prepare_all(bytes, &ImageOptions::default())?;
        all.truncate(1);
        all.pop().ok_or_else(|| KylinError::image_invalid("IMAGE_SHAPE: the image processor made nothing of the image"))
    }

    /// This preparer with a request's options applied: `INPUT_INVALID` naming an option the
    /// model's processor does not read, or a value out of its range.
    pub fn with_options(&self, options: &ImageOptions) -> Result<ImagePreparer> {
        let (model, reads): (&str, &[&str]) = match self.processor {
            Processor::Qwen(_) => ("Qwen's", &["min_pixels", "max_pixels"]),
            Processor::Gemma3 { .. } => ("Gemma 3's", &["do_pan_and_scan"]),
            Processor::Gemma4 { .. } => ("Gemma 4's", &["max_soft_tokens"]),
        };
        if let Some(key) = options.keys().find(|key| !reads.contains(key)) {
            return Err(KylinError::input_invalid(format!(
                "mm_processor_kwargs.{key}: {model} image processor does not read it"
            )));
        }
        let mut out = self.clone();
        match &mut out.processor {
            Processor::Qwen(p) => {
                let (min, max) =
                    (options.min_pixels.unwrap_or(p.min_pixels), options.max_pixels.unwrap_or(p.max_pixels));
                if min == 0 || min > max || max > MAX_REQUEST_PIXELS {
                    return Err(KylinError::input_invalid(format!(
                        "mm_processor_kwargs: the pixel range must satisfy 0 < min_pixels <= max_pixels <= \
                         {MAX_REQUEST_PIXELS}; got min_pixels {min} and max_pixels {max}"
                    )));
                }
                (p.min_pixels, p.max_pixels) = (min, max);
            }
            Processor::Gemma3 { processor, .. } => {
                if let Some(on) = options.do_pan_and_scan {
                    processor.do_pan_and_scan = on;
                }
            }
            Processor::Gemma4 { processor, .. } => {
                if let Some(tokens) = options.max_soft_tokens {
                    if !GEMMA4_SUPPORTED_SOFT_TOKENS.contains(&tokens) {
                        return Err(KylinError::input_invalid(format!(
                            "mm_processor_kwargs.max_soft_tokens must be one of {GEMMA4_SUPPORTED_SOFT_TOKENS:?}; got \
                             {tokens}"
                        )));
                    }
                    processor.max_soft_tokens = tokens;
                }
            }
        }
        Ok(out)
    }

    /// Everything one image file becomes, with a request's options: the whole image, then (Gemma
    /// 3 with `do_pan_and_scan`) its crops, each an input of its own in the order the processor
    /// gives them; the first says how many crops follow ([`ImageInput::crops`]).
    pub fn prepare_all(&self, bytes: &[u8], options: &ImageOptions) -> Result<Vec<ImageInput>> {
        if *options != ImageOptions::default() {
            return self.with_options(options)?.prepare_all(bytes, &ImageOptions::default());
        }
        let image = decode_image(bytes, &self.limits).map_err(image_error)?;
        match &self.processor {
            Processor::Qwen(processor) => {
                let processed = processor.process(&image).map_err(image_error)?;
                let [t, h, w] = processed.grid_thw;
                Ok(vec![ImageInput::new(Arc::from(processed.pixel_values), PatchGrid { t, h, w })])
            }
            Processor::Gemma3 { processor, patch, .. } => {
                let processed = processor.process(&image).map_err(image_error)?;
                let crops = processed.num_crops();
                let mut inputs = processed
                    .images
                    .into_iter()
                    .map(|input| {
                        let size = input.height;
                        let pixels = siglip_patches(&input.pixel_values, size, *patch).ok_or_else(|| {
                            KylinError::image_invalid(format!(
                                "IMAGE_SHAPE: the processed image is {} x {}, not a square of whole patches",
                                input.height, input.width
                            ))
                        })?;
                        let side = size / patch;
                        Ok(ImageInput::new(Arc::from(pixels), PatchGrid { t: 1, h: side, w: side }))
                    })
                    .collect::<Result<Vec<_>>>()?;
                match inputs.first_mut() {
                    Some(whole) => whole.crops = crops,
                    None => {
                        return Err(KylinError::image_invalid(
                            "IMAGE_SHAPE: the image processor made nothing of the image",
                        ));
                    }
                }
                Ok(inputs)
            }
            Processor::Gemma4 { processor, .. } => {
                let processed = processor.process(&image).map_err(image_error)?;
                let grid = PatchGrid { t: 1, h: processed.patches_high, w: processed.patches_wide };
                Ok(vec![ImageInput::new(Arc::from(processed.pixel_values), grid)])
            }
        }
    }

    /// The tokens an image takes in the prompt.
    pub fn tokens(&self, image: &ImageInput) -> usize {
        match &self.processor {
            Processor::Qwen(p) => image.grid.patches() / (p.merge_size * p.merge_size),
            Processor::Gemma3 { tokens, .. } => *tokens,
            Processor::Gemma4 { processor, .. } => {
                image.grid.patches() / (processor.pooling_kernel_size * processor.pooling_kernel_size)
            }
        }
    }

    /// A rendered prompt with each image marker put as the model's processor puts it, before
    /// tokenizing: Gemma 3's `<start_of_image>` becomes the image's whole sequence with its
    /// newlines (which merge with the text's newlines as transformers tokenizes them), and for
    /// an image with pan-and-scan crops `Gemma3Processor`'s sentence introducing the original
    /// and its crops, each its own sequence (`images` in the request's order, crops after their
    /// image: the k-th marker is the k-th whole image's); Qwen's and Gemma 4's text is unchanged
    /// (their placeholders are expanded as tokens by [`ImagePreparer::expand`]).
    pub fn expand_text(&self, text: &str, images: &[ImageInput]) -> String {
        let Processor::Gemma3 { text: Some((boi, full)), .. } = &self.processor else { return text.to_string() };
        let mut crops = whole_images(images).map(|i| i.crops);
        let mut parts = text.split(boi.as_str());
        let mut out = String::with_capacity(text.len() + full.len() * images.len());
        out.push_str(parts.next().unwrap_or_default());
        for part in parts {
            out.push_str(&gemma3_image_prompt(crops.next().unwrap_or(0), full));
            out.push_str(part);
        }
        out
    }

    /// The prompt with each image's placeholder expanded to the tokens the image becomes, as
    /// transformers' processor expands it: Qwen's placeholder (one per image, as chat templates
    /// place them) repeated once per token; for Gemma 3, a prompt already expanded by
    /// [`ImagePreparer::expand_text`] is checked and kept, and one given as ids gets each
    /// `<start_of_image>` followed by the image tokens and `<end_of_image>` (without the
    /// newlines the text expansion adds); for Gemma 4, each image token becomes the begin-of-image
    /// token, the image's tokens and the end-of-image token, and a prompt already expanded (its
    /// image tokens after a begin-of-image token) is checked and kept.
    pub fn expand(&self, prompt: &[u32], images: &[ImageInput]) -> Result<Vec<u32>> {
        let runs = || {
            prompt.iter().enumerate().filter(|&(i, &id)| id == self.image_token_id && (i == 0 || prompt[i - 1] != id))
        };
        let (marker, around) = match &self.processor {
            Processor::Qwen(_) => (self.image_token_id, Around::Nothing),
            Processor::Gemma4 { boi, eoi, .. } => {
                let expanded = runs().filter(|&(i, _)| i > 0 && prompt[i - 1] == *boi).count();
                if expanded > 0 {
                    return if expanded == images.len() && runs().count() == expanded {
                        Ok(prompt.to_vec())
                    } else {
                        Err(KylinError::input_invalid(format!(
                            "the prompt has {expanded} expanded image(s) ({boi} then image tokens {}) and {} \
                             placeholder(s) for {} image(s); give every image as a placeholder or every one expanded",
                            self.image_token_id,
                            runs().count() - expanded,
                            images.len()
                        )))
                    };
                }
                (self.image_token_id, Around::Wrap { boi: *boi, eoi: *eoi })
            }
            Processor::Gemma3 { boi, eoi, .. } => {
                let runs = runs().count();
                if runs > 0 {
                    // Already expanded: the engine checks each run against its image.
                    return if runs == images.len() {
                        Ok(prompt.to_vec())
                    } else {
                        Err(KylinError::input_invalid(format!(
                            "the prompt has {runs} run(s) of image tokens ({}) for {} image(s)",
                            self.image_token_id,
                            images.len()
                        )))
                    };
                }
                (*boi, Around::AfterMarker { eoi: *eoi })
            }
        };
        if images.iter().any(|i| i.crops > 0) {
            // The sentence introducing the crops is text: only a text prompt gets it.
            return Err(KylinError::input_invalid(
                "an image with pan-and-scan crops needs a text or chat prompt (the processor writes a sentence \
                 around its crops); a prompt of token ids takes images without crops",
            ));
        }
        let placeholders = prompt.iter().filter(|&&id| id == marker).count();
        if placeholders != images.len() {
            return Err(KylinError::input_invalid(format!(
                "the prompt has {placeholders} image placeholder token(s) ({marker}) for {} image(s); \
                 the chat template places one per image part",
                images.len()
            )));
        }
        let extra: usize = images.iter().map(|i| self.tokens(i) + 2).sum();
        let mut out = Vec::with_capacity(prompt.len() + extra);
        let mut next = images.iter();
        for &id in prompt {
            let Some(image) = (id == marker).then(|| next.next()).flatten() else {
                out.push(id);
                continue;
            };
            let tokens = std::iter::repeat_n(self.image_token_id, self.tokens(image));
            match around {
                Around::Nothing => out.extend(tokens),
                Around::AfterMarker { eoi } => {
                    out.push(id);
                    out.extend(tokens);
                    out.push(eoi);
                }
                Around::Wrap { boi, eoi } => {
                    out.push(boi);
                    out.extend(tokens);
                    out.push(eoi);
                }
            }
        }
        Ok(out)
    }
}

/// The whole images of a request's list, each followed there by its crops.
fn whole_images(images: &[ImageInput]) -> impl Iterator<Item = &ImageInput> {
    let mut at = 0;
    std::iter::from_fn(move || {
        let image = images.get(at)?;
        at += 1 + image.crops;
        Some(image)
    })
}

/// What surrounds an image's tokens when [`ImagePreparer::expand`] puts them in place of its
/// marker.
#[derive(Debug, Clone, Copy)]
enum Around {
    /// Nothing: the marker is repeated (Qwen).
    Nothing,
    /// The marker stays before them, the end-of-image token follows (Gemma 3's begin-of-image).
    AfterMarker { eoi: u32 },
    /// The marker is replaced by the begin-of-image token, the tokens and the end-of-image token
    /// (Gemma 4's image token).
    Wrap { boi: u32, eoi: u32 },
}
