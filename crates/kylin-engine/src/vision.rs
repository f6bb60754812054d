//! The vision tower of Qwen3.5 vision-language models: from an image's patches
//! (`pixel_values`, as the image processor lays them out) to the rows that replace the image's
//! placeholder tokens in the language model's input.
//!
//! Guarantees:
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
use kylin_loader::vision::{LoadedVision, VisionActivation, VisionConfig};
use kylin_loader::{KylinError, Result};
use kylin_vision::{ImageLimits, QwenImageProcessor, VisionError, decode_image};

use crate::encoder::{Dense, LayerNorm, dtype_of, gelu};
use crate::serving::ImageInput;

/// transformers' `nn.LayerNorm(..., eps=1e-6)` in every norm of the tower.
const NORM_EPS: f32 = 1e-6;

/// Attention rows computed at once (bounds the scores buffer: `QUERY_ROWS · frame` floats).
const QUERY_ROWS: usize = 256;

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

#[derive(Debug, Clone)]
struct Block {
    norm1: LayerNorm,
    qkv: Dense,
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

/// Qwen3.5's vision tower, bound to the checkpoint's tensors.
#[derive(Debug, Clone)]
pub struct VisionTower {
    config: VisionConfig,
    patch_embed: Dense,
    /// The learned position table, `(side², hidden)`, in its stored dtype.
    pos_embed: kylin_loader::WeightTensor,
    blocks: Vec<Block>,
    merger_norm: LayerNorm,
    merger_fc1: Dense,
    merger_fc2: Dense,
    /// `1 / theta^(2i / (head_dim / 2))` for `i < head_dim / 4`: the frequencies each axis uses.
    inv_freq: Vec<f32>,
}

impl VisionTower {
    pub fn new(loaded: &LoadedVision) -> Result<Self> {
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
                    qkv: dense(&format!("blocks.{l}.attn.qkv"))?,
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
            blocks,
            merger_norm: norm("merger.norm")?,
            merger_fc1: dense("merger.linear_fc1")?,
            merger_fc2: dense("merger.linear_fc2")?,
            inv_freq,
            config: c,
        })
    }

    pub fn config(&self) -> &VisionConfig {
        &self.config
    }

    /// The language-model tokens an image of this patch grid becomes.
    pub fn tokens(&self, grid: PatchGrid) -> usize {
        grid.patches() / (self.config.spatial_merge_size * self.config.spatial_merge_size)
    }

    /// Checks a grid and its pixel rows before anything runs.
    pub fn check(&self, pixels: &[f32], grid: PatchGrid) -> Result<()> {
        let c = &self.config;
        let m = c.spatial_merge_size;
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
        loop {
            if let Some(out) = self.advance(pool, &mut encoding, usize::MAX) {
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

        // Each patch's (row, column) in its frame, from the processor's block order.
        let places: Vec<(usize, usize)> = (0..n).map(|p| self.place(p % frame, grid.w)).collect();

        // 1. Patch embedding: pixels (n, patch_values) -> x (n, hidden); plus the position table
        //    resampled to the grid.
        let mut x = vec![0.0f32; n * h];
        self.patch_embed.forward(pool, pixels, n, &mut x);
        self.add_positions(&places, grid, &mut x);

        // 2. 2-D rotary angles per patch, (n, head_dim / 2): the row on the first quarter of the
        //    frequencies, the column on the second.
        let half = hd / 2;
        let quarter = self.inv_freq.len();
        let mut cos = vec![0.0f32; n * half];
        let mut sin = vec![0.0f32; n * half];
        for (p, &(row, col)) in places.iter().enumerate() {
            for i in 0..half {
                let (axis, f) = if i < quarter { (row, i) } else { (col, i - quarter) };
                let angle = axis as f32 * self.inv_freq[f];
                cos[p * half + i] = angle.cos();
                sin[p * half + i] = angle.sin();
            }
        }
        let inter = self.blocks.first().map_or(0, |b| b.fc1.rows());
        let rows = QUERY_ROWS.min(frame);
        Ok(Encoding {
            grid,
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

    /// Runs up to `blocks` more blocks of an encoding (at least one); once every block ran, the
    /// merger too, and gives the tower's output `(tokens, out_hidden)`.
    pub fn advance(&self, pool: &ThreadPool, e: &mut Encoding, blocks: usize) -> Option<Vec<f32>> {
        let end = e.next.saturating_add(blocks.max(1)).min(self.blocks.len());
        for b in e.next..end {
            self.run_block(pool, &self.blocks[b], e);
        }
        e.next = end;
        if e.next < self.blocks.len() {
            return None;
        }
        // 4. The merger: LN per patch, then each block of merge² patches as one row
        //    (tokens, merged_width) -> fc1 (tokens, merged_width) -> gelu -> fc2 (tokens, out).
        let c = &self.config;
        self.merger_norm.rows(&mut e.x);
        let tokens = self.tokens(e.grid);
        let mut merged = vec![0.0f32; tokens * c.merged_width()];
        self.merger_fc1.forward(pool, &e.x, tokens, &mut merged);
        gelu(&mut merged);
        let mut out = vec![0.0f32; tokens * c.out_hidden];
        self.merger_fc2.forward(pool, &merged, tokens, &mut out);
        Some(out)
    }

    /// 3. One block: `x += attn(LN(x))`, `x += mlp(LN(x))`.
    fn run_block(&self, pool: &ThreadPool, block: &Block, e: &mut Encoding) {
        let c = &self.config;
        let (n, h, hd, heads) = (e.grid.patches(), c.hidden, c.head_dim(), c.heads);
        let (frame, half, inter) = (e.grid.h * e.grid.w, hd / 2, e.ones.len());
        let scale = (hd as f32).powf(-0.5);
        // x (n, h) -> LN -> qkv (n, 3h): q, k, v side by side, each (heads, head_dim).
        e.xn.copy_from_slice(&e.x);
        block.norm1.rows(&mut e.xn);
        block.qkv.forward(pool, &e.xn, n, &mut e.qkv);
        for (p, row) in e.qkv.chunks_exact_mut(3 * h).enumerate() {
            let (c_p, s_p) = (&e.cos[p * half..(p + 1) * half], &e.sin[p * half..(p + 1) * half]);
            for head in row[..2 * h].chunks_exact_mut(hd) {
                kernels::rope_rotate_half(head, c_p, s_p);
            }
        }
        // Bidirectional attention within each frame, per head, as matrix products:
        // scores (rows, frame) = Q (rows, hd) · Kᵀ, times the scale, softmax per row, then
        // out (rows, hd) = P (rows, frame) · V, queries taken QUERY_ROWS at a time so the
        // scores stay small whatever the image.
        for f0 in (0..n).step_by(frame) {
            for head in 0..heads {
                for j in 0..frame {
                    let at = (f0 + j) * 3 * h + head * hd;
                    e.keys[j * hd..(j + 1) * hd].copy_from_slice(&e.qkv[at + h..at + h + hd]);
                    e.queries[j * hd..(j + 1) * hd].copy_from_slice(&e.qkv[at..at + hd]);
                    for d in 0..hd {
                        e.values_t[d * frame + j] = e.qkv[at + 2 * h + d];
                    }
                }
                let k = f32_matrix(&e.keys, frame, hd);
                let v_t = f32_matrix(&e.values_t, hd, frame);
                for r0 in (0..frame).step_by(QUERY_ROWS) {
                    let rows = QUERY_ROWS.min(frame - r0);
                    let p = &mut e.probs[..rows * frame];
                    kernels::matmul(pool, k, &e.queries[r0 * hd..(r0 + rows) * hd], rows, p);
                    for row in p.chunks_exact_mut(frame) {
                        kernels::scale(row, scale);
                        kernels::softmax(row);
                    }
                    kernels::matmul(pool, v_t, p, rows, &mut e.head_out[..rows * hd]);
                    for (i, o) in e.head_out[..rows * hd].chunks_exact(hd).enumerate() {
                        let at = (f0 + r0 + i) * h + head * hd;
                        e.attn[at..at + hd].copy_from_slice(o);
                    }
                }
            }
        }
        // attn (n, h) -> proj (n, h); x += proj.
        block.proj.forward(pool, &e.attn, n, &mut e.proj);
        kernels::add_assign(&mut e.x, &e.proj);
        // x -> LN -> fc1 (n, inter) -> act -> fc2 (n, h); x += that.
        e.xn.copy_from_slice(&e.x);
        block.norm2.rows(&mut e.xn);
        block.fc1.forward(pool, &e.xn, n, &mut e.mid);
        match c.activation {
            // The kernels' GeGLU with an "up" of ones: gelu_tanh(x) · 1.
            VisionActivation::GeluTanh => {
                e.mid.chunks_exact_mut(inter).for_each(|row| kernels::gelu_tanh_mul(row, &e.ones))
            }
            VisionActivation::Gelu => gelu(&mut e.mid),
        }
        block.fc2.forward(pool, &e.mid, n, &mut e.proj);
        kernels::add_assign(&mut e.x, &e.proj);
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
        let table = WeightMatrix {
            dtype: dtype_of(&self.pos_embed).unwrap_or(kernels::WeightDType::F32),
            rows: side * side,
            cols: h,
            data: self.pos_embed.bytes(),
        };
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

/// From an image file's bytes to a request's [`ImageInput`], as the checkpoint's
/// `preprocessor_config.json` says (transformers' Qwen2-VL image processor), and the prompt's
/// image placeholders expanded to the tokens each image becomes. Cheap to share: the server's
/// handlers prepare images on their own threads, not the engine's.
#[derive(Debug, Clone)]
pub struct ImagePreparer {
    processor: QwenImageProcessor,
    limits: ImageLimits,
    image_token_id: u32,
}

/// A refused image as Kylin's error: `IMAGE_INVALID`, the decoder's own code first.
fn image_error(e: VisionError) -> KylinError {
    KylinError::image_invalid(format!("{}: {}", e.code(), e.message))
}

impl ImagePreparer {
    /// The preparer of a tower's images: `None` without a `preprocessor_config.json` (then
    /// only images given as patches run), `CONFIG_INVALID` when it is malformed or disagrees
    /// with the tower (patch, frame or merge size).
    pub fn new(loaded: &LoadedVision) -> Result<Option<Self>> {
        let Some(text) = loaded.preprocessor.as_deref() else { return Ok(None) };
        let processor = QwenImageProcessor::from_json(text)
            .map_err(|e| KylinError::config_invalid(format!("preprocessor_config.json: {}", e.message)))?;
        let c = &loaded.config;
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
        let processed = self.processor.process(&image).map_err(image_error)?;
        let [t, h, w] = processed.grid_thw;
        Ok(ImageInput { pixels: Arc::from(processed.pixel_values), grid: PatchGrid { t, h, w } })
    }

    /// The tokens an image takes in the prompt.
    pub fn tokens(&self, image: &ImageInput) -> usize {
        let m = self.processor.merge_size;
        image.grid.patches() / (m * m)
    }

    /// The prompt with each image placeholder (one per image, as chat templates place them)
    /// repeated once per token of its image, as transformers' processor expands it.
    pub fn expand(&self, prompt: &[u32], images: &[ImageInput]) -> Result<Vec<u32>> {
        let placeholders = prompt.iter().filter(|&&id| id == self.image_token_id).count();
        if placeholders != images.len() {
            return Err(KylinError::input_invalid(format!(
                "the prompt has {placeholders} image placeholder token(s) ({}) for {} image(s); \
                 the chat template places one per image part",
                self.image_token_id,
                images.len()
            )));
        }
        let extra: usize = images.iter().map(|i| self.tokens(i).saturating_sub(1)).sum();
        let mut out = Vec::with_capacity(prompt.len() + extra);
        let mut next = images.iter();
        for &id in prompt {
            match (id == self.image_token_id).then(|| next.next()).flatten() {
                Some(image) => out.extend(std::iter::repeat_n(id, self.tokens(image))),
                None => out.push(id),
            }
        }
        Ok(out)
    }
}
