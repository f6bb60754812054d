//! A prefill product for work that needs no GEMV twin (the vision towers): `y = x · Wᵀ` with
//! the weights packed, panel by panel, into f32 column-major strips of 16 output rows, and an
//! outer-product register tile of 6 tokens × 16 rows (12 accumulators; per column two weight
//! loads and six broadcasts feed twelve fused multiply-adds).
//!
//! [`crate::matmul`]'s GEMM reduces each output in the GEMV's order so that a token gives the
//! same bits alone or in a batch; that order (four 8-lane accumulators per output along the
//! columns) leaves room for only a 3 × 1 tile on AVX2, which loads as much as it multiplies.
//! This product takes another order, just as fixed:
//!
//! - **Order**: every output `y[t, r]` is one sequential chain of fused multiply-adds over the
//!   columns, `acc = fma(x[t, c], w[r, c], acc)` for `c = 0, 1, …` from `acc = 0`, whatever the
//!   number of tokens, the token's place among them, the tile it lands in or the thread count.
//!   So a token gives the same bits alone or with others (batch invariance), and a tower cut
//!   into slices computes every row the same way. The scalar path runs the same chain
//!   (`f32::mul_add`), so every ISA gives the same bits.
//! - **Accuracy**: f32 accumulation in one chain; against an f64 sum the error is within about
//!   `cols · 2⁻²⁴` relative to `Σ|w·x|`.
//! - **Memory**: each thread widens one panel (`16 × cols` floats) at a time into a buffer of
//!   its own that grows to the widest matrix it has seen and is kept: no allocation once warm.

use std::cell::RefCell;

use crate::matmul::OutPtr;
use crate::{Isa, ThreadPool, WeightMatrix, isa};

/// Output rows per packed panel: two 8-lane vectors.
pub const PANEL_ROWS: usize = 16;
/// Tokens per register tile.
pub const TILE_TOKENS: usize = 6;
/// Multiply-adds below which the product is not split across threads.
const MIN_PARALLEL_MACS: usize = 1 << 20;

thread_local! {
    /// This thread's packed panel, `(cols, PANEL_ROWS)`, then one widened row, `(cols)`.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// `y (n, rows) = x (n, cols) · Wᵀ (cols, rows)`, every output one sequential chain of fused
/// multiply-adds over the columns (see the module's guarantees). Panics if a shape or a data
/// length disagrees (a caller bug).
pub fn gemm_packed(pool: &ThreadPool, w: WeightMatrix<'_>, x: &[f32], n: usize, y: &mut [f32]) {
    // These checks make the unsafe reads and writes below sound.
    assert_eq!(w.data.len(), w.rows * w.cols * w.dtype.size_in_bytes(), "weight data length != rows * cols * size");
    assert_eq!(x.len(), n * w.cols, "x.len() != n * cols");
    assert_eq!(y.len(), n * w.rows, "y.len() != n * rows");
    if n == 0 || w.rows == 0 {
        return;
    }
    if w.cols == 0 {
        y.fill(0.0);
        return;
    }
    let panels = w.rows.div_ceil(PANEL_ROWS);
    let out = OutPtr(y.as_mut_ptr());
    let avx2 = matches!(isa(), Isa::Avx2Fma | Isa::Avx512);
    let task = |p: usize| {
        // Captures the whole `OutPtr` (which is `Sync`), not its raw pointer field.
        let out = &out;
        // SAFETY: panel `p` writes only columns `p * PANEL_ROWS..` (below `rows`) of every
        // token's output row, which no other panel writes; `y` outlives the pool job.
        unsafe { run_panel(w, x, n, p, out.0, avx2) };
    };
    if n * w.rows * w.cols < MIN_PARALLEL_MACS {
        (0..panels).for_each(task);
    } else {
        pool.run(panels, &task);
    }
}

/// Packs panel `p` of `w` and multiplies every token by it.
///
/// # Safety
/// `y` must be valid for writing `(n, w.rows)` floats, of which this call writes only columns
/// `p * PANEL_ROWS..min((p + 1) * PANEL_ROWS, rows)`; shapes as [`gemm_packed`] checked them.
unsafe fn run_panel(w: WeightMatrix<'_>, x: &[f32], n: usize, p: usize, y: *mut f32, avx2: bool) {
    let (r0, r1) = (p * PANEL_ROWS, ((p + 1) * PANEL_ROWS).min(w.rows));
    let k = w.cols;
    PANEL.with(|cell| {
        let mut buffer = cell.borrow_mut();
        if buffer.len() < k * (PANEL_ROWS + 1) {
            buffer.resize(k * (PANEL_ROWS + 1), 0.0);
        }
        let (panel, row) = buffer.split_at_mut(k * PANEL_ROWS);
        let row = &mut row[..k];
        // Pack: panel[c * PANEL_ROWS + i] = w[r0 + i, c], zeros past the last row.
        for i in 0..PANEL_ROWS {
            if r0 + i < r1 {
                crate::widen_row(w, r0 + i, row);
                for (c, &v) in row.iter().enumerate() {
                    panel[c * PANEL_ROWS + i] = v;
                }
            } else {
                for c in 0..k {
                    panel[c * PANEL_ROWS + i] = 0.0;
                }
            }
        }
        let panel = &panel[..k * PANEL_ROWS];
        let mut t0 = 0;
        while t0 < n {
            let mt = TILE_TOKENS.min(n - t0);
            // SAFETY: tokens `t0..t0 + mt` are inside `x` and `y`; columns `r0..r1` of their
            // output rows are this panel's (the caller's contract).
            unsafe {
                let (xt, yt) = (x.as_ptr().add(t0 * k), y.add(t0 * w.rows + r0));
                if avx2 {
                    #[cfg(target_arch = "x86_64")]
                    crate::x86::gemm_packed_tile(mt, panel.as_ptr(), k, xt, yt, w.rows, r1 - r0);
                } else {
                    scalar_tile(mt, panel, k, xt, yt, w.rows, r1 - r0);
                }
            }
            t0 += mt;
        }
    });
}

/// The tile without SIMD, in the same order: `y[t, i] = chain over c of fma(x[t, c],
/// panel[c, i], ·)` for `t < mt`, `i < nr`.
///
/// # Safety
/// `x` valid for `(mt, k)` floats, `y` for writing `y[t * y_stride + i]`, `t < mt`, `i < nr`.
unsafe fn scalar_tile(mt: usize, panel: &[f32], k: usize, x: *const f32, y: *mut f32, y_stride: usize, nr: usize) {
    for t in 0..mt {
        for i in 0..nr {
            let mut acc = 0.0f32;
            for c in 0..k {
                // SAFETY: `t < mt` and `c < k`: inside the caller's `x`.
                acc = unsafe { *x.add(t * k + c) }.mul_add(panel[c * PANEL_ROWS + i], acc);
            }
            // SAFETY: `t < mt`, `i < nr`: inside the caller's `y`.
            unsafe { *y.add(t * y_stride + i) = acc };
        }
    }
}
