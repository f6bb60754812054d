//! The vision towers of vision-language models: from an image's patches (`pixel_values`, as
//! the image processor lays them out) to the rows that replace the image's placeholder tokens
//! in the language model's input. Two towers: Qwen3.5's and Gemma 3's (SigLIP and its
//! projector); they share the pre-norm block and differ in their positions and their head.
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
    Gemma3ImageProcessor, ImageLimits, QwenImageProcessor, VisionError, decode_image, gemma3_full_image_sequence,
};

use crate::encoder::{Dense, LayerNorm, dtype_of, gelu};
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

/// A block's query, key and value projections: one fused matrix (Qwen, `(3 · hidden, hidden)`)
/// or three (SigLIP, each `(hidden, hidden)`).
#[derive(Debug, Clone)]
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
}

#[derive(Debug, Clone)]
struct Block {
    norm1: LayerNorm,
    qkv: Qkv,
    proj: Dense,
    norm2: LayerNorm,
    fc1: Dense,
    fc2: Dense,
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
}

/// A vision tower (Qwen3.5's or Gemma 3's), bound to the checkpoint's tensors.
#[derive(Debug, Clone)]
pub struct VisionTower {
    config: VisionConfig,
    patch_embed: Dense,
    /// The learned position table, `(positions, hidden)`, in its stored dtype.
    pos_embed: kylin_loader::WeightTensor,
    stem: Stem,
    blocks: Vec<Block>,
    head: Head,
}

impl VisionTower {
    pub fn new(loaded: &LoadedVision) -> Result<Self> {
        match loaded.config.kind {
            VisionKind::Qwen35 => Self::qwen(loaded),
            VisionKind::Gemma3 { .. } => Self::gemma3(loaded),
        }
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
            blocks,
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
        let widen = |role: &str, rows: usize, cols: usize| -> Result<Vec<f32>> {
            let t = loaded.tensor(role)?;
            let m = WeightMatrix { dtype: dtype_of(t)?, rows, cols, data: t.bytes() };
            let mut out = vec![0.0f32; rows * cols];
            for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                kernels::widen_row(m, r, row);
            }
            Ok(out)
        };
        let (h, out) = (c.hidden, c.out_hidden);
        let soft_norm = widen("multi_modal_projector.mm_soft_emb_norm.weight", 1, h)?.iter().map(|w| 1.0 + w).collect();
        // (hidden, out_hidden) as stored -> (out_hidden, hidden): one copy at load, a few MB.
        let stored = widen("multi_modal_projector.mm_input_projection_weight", h, out)?;
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
            blocks,
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
        if grid.t == 0 || grid.h == 0 || grid.w == 0 || grid.h % m != 0 || grid.w % m != 0 {
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

        // 1. Patch embedding: pixels (n, patch_values) -> x (n, hidden).
        let mut x = vec![0.0f32; n * h];
        self.patch_embed.forward(pool, pixels, n, &mut x);
        let half = hd / 2;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        match &self.stem {
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
        let inter = self.blocks.first().map_or(0, |b| b.fc1.rows());
        let rows = QUERY_ROWS.min(frame);
        Ok(Encoding {
            grid,
            stage: Stage::Project { row: 0 },
            x,
            cos,
            sin,
            next: 0,
            xn: vec![0.0; n * h],
            qkv: vec![0.0; n * 3 * h],
            attn: vec![0.0; n * h],
            proj: vec![0.0; n * h],
            mid: vec![0.0; n * inter],
            keys: vec![0.0; frame * hd],
            queries: vec![0.0; frame * hd],
            values_t: vec![0.0; hd * frame],
            probs: vec![0.0; rows * frame],
            head_out: vec![0.0; rows * hd],
            ones: vec![1.0; inter],
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
                fc1.forward(pool, &e.x, tokens, &mut merged);
                gelu(&mut merged);
                fc2.forward(pool, &merged, tokens, &mut out);
            }
            Head::Gemma3 { post_norm, soft_norm, eps, projection } => {
                // 4. LN per patch; the (side, side) grid averaged over pool × pool windows into
                //    (tokens, hidden), raster order; RMSNorm · (1 + w); then
                //    (tokens, hidden) · projectionᵀ (out_hidden, hidden) -> (tokens, out_hidden).
                post_norm.rows(&mut e.x);
                let (h, k, side) = (c.hidden, c.spatial_merge_size, e.grid.w);
                let per_side = side / k;
                let mut pooled = vec![0.0f32; tokens * h];
                for (t, row) in pooled.chunks_exact_mut(h).enumerate() {
                    let (ty, tx) = (t / per_side, t % per_side);
                    for dy in 0..k {
                        for dx in 0..k {
                            let p = (ty * k + dy) * side + tx * k + dx;
                            kernels::add_assign(row, &e.x[p * h..(p + 1) * h]);
                        }
                    }
                    kernels::scale(row, 1.0 / (k * k) as f32);
                    let mean_square = row.iter().map(|v| v * v).sum::<f32>() / h as f32;
                    let inv = 1.0 / (mean_square + eps).sqrt();
                    for (v, w) in row.iter_mut().zip(soft_norm) {
                        *v = *v * inv * w;
                    }
                }
                kernels::matmul(pool, f32_matrix(projection, c.out_hidden, h), &pooled, tokens, &mut out);
            }
        }
        Some(out)
    }

    /// The learned position table as a matrix `(positions, hidden)`.
    fn position_table(&self) -> WeightMatrix<'_> {
        WeightMatrix {
            dtype: dtype_of(&self.pos_embed).unwrap_or(kernels::WeightDType::F32),
            rows: self.config.num_position_embeddings,
            cols: self.config.hidden,
            data: self.pos_embed.bytes(),
        }
    }

    /// Where token `j`'s query, key and value start in `qkv` (add `j * stride + head * hd`):
    /// side by side per token (Qwen's fused projection, `(n, 3h)`) or one after the other
    /// (SigLIP's three, `(3, n, h)`).
    fn qkv_layout(&self, n: usize) -> ([usize; 3], usize) {
        let h = self.config.hidden;
        match self.blocks.first().map(|b| &b.qkv) {
            Some(Qkv::Separate { .. }) => ([0, n * h, 2 * n * h], h),
            _ => ([0, h, 2 * h], 3 * h),
        }
    }

    /// 3. One unit of the current block's work, then the next stage; returns the
    /// multiply-adds it took. A block (`x += attn(LN(x))`, `x += mlp(LN(x))`) is cut into units
    /// that each read every weight of their part once: the projections of [`UNIT_ROWS`] patch
    /// rows, the attention of one head over [`QUERY_ROWS`] queries, the output projection and
    /// MLP of [`UNIT_ROWS`] rows. Every row's arithmetic is the same whatever the cut.
    fn run_unit(&self, pool: &ThreadPool, e: &mut Encoding, unit_rows: usize) -> u64 {
        let c = &self.config;
        let block = &self.blocks[e.next];
        let (n, h, hd, heads) = (e.grid.patches(), c.hidden, c.head_dim(), c.heads);
        let (frame, half, inter) = (e.grid.h * e.grid.w, hd / 2, e.ones.len());
        let ([at_q, at_k, at_v], stride) = self.qkv_layout(n);
        match e.stage {
            Stage::Project { row } => {
                // x rows (m, h) -> LN -> q, k, v rows; rotary on q and k (Qwen).
                let (r0, r1) = (row, row.saturating_add(unit_rows).min(n));
                let m = r1 - r0;
                e.xn[r0 * h..r1 * h].copy_from_slice(&e.x[r0 * h..r1 * h]);
                block.norm1.rows(&mut e.xn[r0 * h..r1 * h]);
                let xn = &e.xn[r0 * h..r1 * h];
                match &block.qkv {
                    Qkv::Fused(qkv) => {
                        // (m, h) -> (m, 3h).
                        qkv.forward(pool, xn, m, &mut e.qkv[r0 * 3 * h..r1 * 3 * h]);
                        if !e.cos.is_empty() {
                            for p in r0..r1 {
                                let (c_p, s_p) = (&e.cos[p * half..(p + 1) * half], &e.sin[p * half..(p + 1) * half]);
                                for head in e.qkv[p * 3 * h..p * 3 * h + 2 * h].chunks_exact_mut(hd) {
                                    kernels::rope_rotate_half(head, c_p, s_p);
                                }
                            }
                        }
                    }
                    Qkv::Separate { q, k, v } => {
                        // (m, h) -> three (m, h), into their parts of qkv (3, n, h).
                        for (dense, at) in [(q, at_q), (k, at_k), (v, at_v)] {
                            dense.forward(pool, xn, m, &mut e.qkv[at + r0 * h..at + r1 * h]);
                        }
                    }
                }
                e.stage = if r1 == n { Stage::Attend { f0: 0, head: 0, row: 0 } } else { Stage::Project { row: r1 } };
                (m * h * 3 * h) as u64
            }
            Stage::Attend { f0, head, row } => {
                // Bidirectional attention within each frame, per head, as matrix products:
                // scores (rows, frame) = Q (rows, hd) · Kᵀ, times the scale, softmax per row,
                // then out (rows, hd) = P (rows, frame) · V, queries taken QUERY_ROWS at a time
                // so the scores stay small whatever the image.
                if row == 0 {
                    for j in 0..frame {
                        let at = (f0 + j) * stride + head * hd;
                        e.keys[j * hd..(j + 1) * hd].copy_from_slice(&e.qkv[at_k + at..at_k + at + hd]);
                        e.queries[j * hd..(j + 1) * hd].copy_from_slice(&e.qkv[at_q + at..at_q + at + hd]);
                        for d in 0..hd {
                            e.values_t[d * frame + j] = e.qkv[at_v + at + d];
                        }
                    }
                }
                let k = f32_matrix(&e.keys, frame, hd);
                let v_t = f32_matrix(&e.values_t, hd, frame);
                let rows = QUERY_ROWS.min(frame - row);
                let p = &mut e.probs[..rows * frame];
                kernels::matmul(pool, k, &e.queries[row * hd..(row + rows) * hd], rows, p);
                let scale = (hd as f32).powf(-0.5);
                for r in p.chunks_exact_mut(frame) {
                    kernels::scale(r, scale);
                    kernels::softmax(r);
                }
                kernels::matmul(pool, v_t, p, rows, &mut e.head_out[..rows * hd]);
                for (i, o) in e.head_out[..rows * hd].chunks_exact(hd).enumerate() {
                    let at = (f0 + row + i) * h + head * hd;
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
                // attn rows (m, h) -> proj (m, h); x += proj.
                block.proj.forward(pool, &e.attn[r0 * h..r1 * h], m, proj);
                kernels::add_assign(x, proj);
                // x -> LN -> fc1 (m, inter) -> act -> fc2 (m, h); x += that.
                let xn = &mut e.xn[r0 * h..r1 * h];
                xn.copy_from_slice(x);
                block.norm2.rows(xn);
                let mid = &mut e.mid[r0 * inter..r1 * inter];
                block.fc1.forward(pool, xn, m, mid);
                match c.activation {
                    // The kernels' GeGLU with an "up" of ones: gelu_tanh(x) · 1.
                    VisionActivation::GeluTanh => {
                        mid.chunks_exact_mut(inter).for_each(|r| kernels::gelu_tanh_mul(r, &e.ones))
                    }
                    VisionActivation::Gelu => gelu(mid),
                }
                block.fc2.forward(pool, mid, m, proj);
                kernels::add_assign(x, proj);
                if r1 == n {
                    e.next += 1;
                    e.stage = Stage::Project { row: 0 };
                } else {
                    e.stage = Stage::Feed { row: r1 };
                }
                (m * (h * h + 2 * h * inter)) as u64
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

/// A channel-first image `(3, size, size)` as SigLIP's convolution reads it: one row per patch in
/// raster order, `(patches, 3 · patch²)`, each row `(channel, row in patch, column in patch)`.
/// `None` when the values do not make such an image.
pub fn siglip_patches(pixels: &[f32], size: usize, patch: usize) -> Option<Vec<f32>> {
    if patch == 0 || size % patch != 0 || Some(pixels.len()) != size.checked_mul(size)?.checked_mul(3) {
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
}

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
    /// wrong with it).
    pub fn prepare(&self, bytes: &[u8]) -> Result<ImageInput> {
        let image = decode_image(bytes, &self.limits).map_err(image_error)?;
        match &self.processor {
            Processor::Qwen(processor) => {
                let processed = processor.process(&image).map_err(image_error)?;
                let [t, h, w] = processed.grid_thw;
                Ok(ImageInput { pixels: Arc::from(processed.pixel_values), grid: PatchGrid { t, h, w } })
            }
            Processor::Gemma3 { processor, patch, .. } => {
                let processed = processor.process(&image).map_err(image_error)?;
                let whole = processed.images.into_iter().next().ok_or_else(|| {
                    KylinError::image_invalid("IMAGE_SHAPE: the image processor made nothing of the image")
                })?;
                let size = whole.height;
                let pixels = siglip_patches(&whole.pixel_values, size, *patch).ok_or_else(|| {
                    KylinError::image_invalid(format!(
                        "IMAGE_SHAPE: the processed image is {} x {}, not a square of whole patches",
                        whole.height, whole.width
                    ))
                })?;
                let side = size / patch;
                Ok(ImageInput { pixels: Arc::from(pixels), grid: PatchGrid { t: 1, h: side, w: side } })
            }
        }
    }

    /// The tokens an image takes in the prompt.
    pub fn tokens(&self, image: &ImageInput) -> usize {
        match &self.processor {
            Processor::Qwen(p) => image.grid.patches() / (p.merge_size * p.merge_size),
            Processor::Gemma3 { tokens, .. } => *tokens,
        }
    }

    /// A rendered prompt with each image marker put as the model's processor puts it, before
    /// tokenizing: Gemma 3's `<start_of_image>` becomes the image's whole sequence with its
    /// newlines (which merge with the text's newlines as transformers tokenizes them); Qwen's
    /// text is unchanged (its placeholder is expanded as tokens by [`ImagePreparer::expand`]).
    pub fn expand_text(&self, text: &str) -> String {
        match &self.processor {
            Processor::Gemma3 { text: Some((boi, full)), .. } => text.replace(boi.as_str(), full),
            _ => text.to_string(),
        }
    }

    /// The prompt with each image's placeholder expanded to the tokens the image becomes, as
    /// transformers' processor expands it: Qwen's placeholder (one per image, as chat templates
    /// place them) repeated once per token; for Gemma 3, a prompt already expanded by
    /// [`ImagePreparer::expand_text`] is checked and kept, and one given as ids gets each
    /// `<start_of_image>` followed by the image tokens and `<end_of_image>` (without the
    /// newlines the text expansion adds).
    pub fn expand(&self, prompt: &[u32], images: &[ImageInput]) -> Result<Vec<u32>> {
        let (marker, after) = match &self.processor {
            Processor::Qwen(_) => (self.image_token_id, None),
            Processor::Gemma3 { boi, eoi, tokens, .. } => {
                let runs = prompt
                    .iter()
                    .enumerate()
                    .filter(|&(i, &id)| id == self.image_token_id && (i == 0 || prompt[i - 1] != id))
                    .count();
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
                (*boi, Some((*tokens, *eoi)))
            }
        };
        let placeholders = prompt.iter().filter(|&&id| id == marker).count();
        if placeholders != images.len() {
            return Err(KylinError::input_invalid(format!(
                "the prompt has {placeholders} image placeholder token(s) ({marker}) for {} image(s); \
                 the chat template places one per image part",
                images.len()
            )));
        }
        let extra: usize = images.iter().map(|i| self.tokens(i) + 1).sum();
        let mut out = Vec::with_capacity(prompt.len() + extra);
        let mut next = images.iter();
        for &id in prompt {
            match ((id == marker).then(|| next.next()).flatten(), after) {
                (Some(image), None) => out.extend(std::iter::repeat_n(id, self.tokens(image))),
                (Some(_), Some((tokens, eoi))) => {
                    out.push(id);
                    out.extend(std::iter::repeat_n(self.image_token_id, tokens));
                    out.push(eoi);
                }
                (None, _) => out.push(id),
            }
        }
        Ok(out)
    }
}
