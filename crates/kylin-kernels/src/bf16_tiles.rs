//! BF16 weights repacked at load into AMX's B-tile order, so that decode on AMX streams each
//! 16-row block as whole 1 KiB tiles in sequence instead of 16 strided rows.
//!
//! Under `Precision::Bf16` on AMX the engine copies each tileable matrix of its products
//! ([`crate::amx::tileable`]: whole tiles of 16 rows × 32 columns) into a [`Bf16TileBuffer`]
//! and runs its products through [`matmul_many_bf16_tiles`]. The outputs have the bits of
//! [`crate::matmul_many_bf16`] on the row-major weights (the same `tdpbf16ps` chain per output,
//! the roles of the tiles swapped), so batch invariance and every exactness test carry over;
//! what changes is the layout the weights are read in. A row block keeps its byte range, so a
//! split of the rows across threads reads the same bytes in both layouts.

use crate::aligned::AlignedBytes;
use crate::{ThreadPool, WeightDType, WeightMatrix};

/// Whether BF16 matrices are copied into tiles: where the BF16 products run on AMX, unless
/// `KYLIN_BF16_TILES=0` keeps every weight in place in the map (the same results, decode slower,
/// no copy at load: on a virtual machine whose host reclaims the memory a guest frees, the first
/// touch of new memory can run at about 100 MB/s, which made qwen3-0.6b-shaped's load take
/// 9 s instead of 0.3 on one such machine).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::bf16_kernels() == Some(crate::Bf16Kernels::Amx) && crate::env_switch(&ON, &["KYLIN_BF16_TILES"])
}

/// A BF16 matrix in the tiled layout ([`crate::amx`]'s `tile_weights`), in 64-byte aligned
/// memory on huge pages where the system has them.
pub struct Bf16TileBuffer {
    bytes: AlignedBytes,
    rows: usize,
    cols: usize,
}

impl std::fmt::Debug for Bf16TileBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bf16TileBuffer({} x {})", self.rows, self.cols)
    }
}

impl Bf16TileBuffer {
    /// `w` in the tiled layout, when this process runs BF16 products on AMX ([`enabled`]), `w`
    /// is BF16 and tileable (whole tiles of 16 rows × 32 columns); `None` otherwise.
    pub fn new(w: WeightMatrix<'_>) -> Option<Bf16TileBuffer> {
        #[cfg(target_arch = "x86_64")]
        {
            if !enabled()
                || w.dtype != WeightDType::BF16
                || !crate::amx::tileable(w.rows, w.cols)
                || w.data.len() != w.rows * w.cols * 2
            {
                return None;
            }
            let mut bytes = AlignedBytes::zeroed(w.data.len())?;
            // Whole row blocks keep their byte ranges, so parts of the rows are tiled apart, one
            // per core: most of the time goes to the kernel zeroing the new pages on first
            // touch, which runs on each touching core.
            let parts = std::thread::available_parallelism().map_or(1, |n| n.get()).min(w.rows / crate::amx::TILE);
            let part_rows = (w.rows / crate::amx::TILE).div_ceil(parts) * crate::amx::TILE;
            let part_bytes = part_rows * w.cols * 2;
            std::thread::scope(|scope| {
                for (source, out) in w.data.chunks(part_bytes).zip(bytes.chunks_mut(part_bytes)) {
                    scope.spawn(move || crate::amx::tile_weights(source, source.len() / (w.cols * 2), w.cols, out));
                }
            });
            Some(Bf16TileBuffer { bytes, rows: w.rows, cols: w.cols })
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = (w, WeightDType::BF16);
            None
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// Row `r` widened to f32 into `out[..cols]`: the layout read back, which the kernels' tests
    /// compare with the matrix it was copied from.
    /// Panics if `r >= rows` or `out` is shorter than a row (caller bugs).
    pub fn widen_row(&self, r: usize, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        crate::amx::widen_tiled_row(&self.bytes, self.rows, self.cols, r, out);
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (r, out);
    }

    /// The tiled bytes as a matrix view, for [`matmul_many_bf16_tiles`] only (its `data` is not
    /// row-major).
    pub fn matrix(&self) -> WeightMatrix<'_> {
        WeightMatrix { dtype: WeightDType::BF16, rows: self.rows, cols: self.cols, data: &self.bytes }
    }
}

/// `y_i = bf16(x) · W_iᵀ` for every `(W_i, y_i)` in `jobs`, each `W_i` a
/// [`Bf16TileBuffer::matrix`], with the activations rounded to BF16 once into `packed` (at
/// least [`crate::bf16_scratch_len`]`(n_tokens, cols)` elements) and f32 accumulation on AMX:
/// the bits of [`crate::matmul_many_bf16`] on the same weights row-major.
///
/// Shapes as [`crate::matmul_many`]. Panics if a shape or a data length disagrees, a matrix is
/// not tileable or `packed` is too short (caller bugs).
pub fn matmul_many_bf16_tiles(
    pool: &ThreadPool,
    x: &[f32],
    n_tokens: usize,
    packed: &mut [u16],
    jobs: &mut [(WeightMatrix<'_>, &mut [f32])],
) {
    #[cfg(target_arch = "x86_64")]
    {
        assert_eq!(crate::bf16_kernels(), Some(crate::Bf16Kernels::Amx), "tiled BF16 weights need AMX");
        for (w, _) in jobs.iter() {
            assert!(crate::amx::tileable(w.rows, w.cols), "a {} x {} matrix is not tileable", w.rows, w.cols);
        }
        crate::matmul::matmul_many_bf16_with(
            pool,
            x,
            n_tokens,
            packed,
            jobs,
            crate::amx::TILE,
            2 * crate::amx::TILE,
            crate::amx::pack_token_rows,
            // SAFETY: AMX permission was granted (asserted above); the driver checked the
            // shapes and hands each task its own rows in 32-row units (whole 16-row blocks:
            // every tileable matrix has a multiple of 16 rows).
            &|w, packed, out, r0, r1| unsafe {
                crate::amx::gemm_tiled_rows(w.data.as_ptr(), w.rows, w.cols, packed, n_tokens, out, w.rows, r0, r1)
            },
        );
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (pool, x, n_tokens, packed, jobs);
        unreachable!("no tiled BF16 weights on this architecture")
    }
}
