//! `gemm_packed`, the vision towers' product: every output is one sequential chain of fused
//! multiply-adds over the columns. Checked bit for bit against that chain written out here, so
//! every token gives the same bits alone or in a batch of any size and on any thread count;
//! against an f64 sum within f32 rounding; on every ISA the machine has (a second test re-runs
//! this binary with `KYLIN_KERNELS_ISA=avx2` and `scalar`).

use kylin_kernels::{PANEL_ROWS, TILE_TOKENS, ThreadPool, WeightDType, WeightMatrix, gemm_packed, widen_row};

#[path = "support/rng.rs"]
mod rng;

use rng::Rng;

const DTYPES: [WeightDType; 3] = [WeightDType::BF16, WeightDType::F16, WeightDType::F32];
/// Rows around the 16-row panels, columns around the 8-lane vectors, tokens around the 6-token
/// tiles.
const ROWS: [usize; 6] = [1, 15, 16, 17, 33, 100];
const COLS: [usize; 6] = [1, 7, 8, 64, 257, 1031];
const TOKENS: [usize; 8] = [1, 2, 5, 6, 7, 12, 13, 40];

/// The documented order: `acc = fma(x[t, c], w[r, c], acc)` for `c = 0..cols` from zero.
fn chain(w: WeightMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let mut row = vec![0.0f32; w.cols];
    let mut y = vec![0.0f32; n * w.rows];
    for r in 0..w.rows {
        widen_row(w, r, &mut row);
        for t in 0..n {
            let mut acc = 0.0f32;
            for (c, &wv) in row.iter().enumerate() {
                acc = x[t * w.cols + c].mul_add(wv, acc);
            }
            y[t * w.rows + r] = acc;
        }
    }
    y
}

#[test]
fn every_output_is_the_documented_chain_whatever_the_batch_and_threads() {
    assert_eq!((PANEL_ROWS, TILE_TOKENS), (16, 6));
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for dtype in DTYPES {
        for rows in ROWS {
            for cols in COLS {
                let data = rng.weights(dtype, rows * cols);
                let w = WeightMatrix { dtype, rows, cols, data: &data };
                let most = *TOKENS.last().unwrap();
                let x = rng.vec(most * cols);
                let want = chain(w, &x, most);
                for n in TOKENS {
                    for pool in &pools {
                        let mut y = vec![f32::NAN; n * rows];
                        gemm_packed(pool, w, &x[..n * cols], n, &mut y);
                        let same = y.iter().zip(&want[..n * rows]).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{dtype:?} {rows}x{cols}, {n} tokens, {} threads", pool.threads());
                    }
                }
            }
        }
    }
}

#[test]
fn a_large_product_split_across_threads_matches_an_f64_sum() {
    // Large enough to be split into panels across the pool (over 2^20 multiply-adds).
    let (rows, cols, n) = (200, 768, 70);
    let mut rng = Rng(7);
    let data = rng.weights(WeightDType::BF16, rows * cols);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
    let x = rng.vec(n * cols);
    let mut y = vec![0.0f32; n * rows];
    gemm_packed(&ThreadPool::new(2), w, &x, n, &mut y);
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        widen_row(w, r, &mut row);
        for t in 0..n {
            let terms = row.iter().zip(&x[t * cols..(t + 1) * cols]).map(|(&a, &b)| f64::from(a) * f64::from(b));
            let (sum, magnitude) = terms.fold((0.0f64, 0.0f64), |(s, m), v| (s + v, m + v.abs()));
            let err = (f64::from(y[t * rows + r]) - sum).abs();
            assert!(err <= magnitude * cols as f64 * 2f64.powi(-24), "({t}, {r}): {err} of {magnitude}");
        }
    }
    // Every token alone gives its row of the batch, bit for bit.
    for t in [0, 5, 6, 69] {
        let mut alone = vec![0.0f32; rows];
        gemm_packed(&ThreadPool::new(1), w, &x[t * cols..(t + 1) * cols], 1, &mut alone);
        assert!(alone.iter().zip(&y[t * rows..(t + 1) * rows]).all(|(a, b)| a.to_bits() == b.to_bits()), "token {t}");
    }
}

#[test]
fn empty_shapes_do_nothing_or_give_zeros() {
    let pool = ThreadPool::new(1);
    let data = [0u8; 0];
    let w = WeightMatrix { dtype: WeightDType::F32, rows: 3, cols: 0, data: &data };
    let mut y = vec![f32::NAN; 6];
    gemm_packed(&pool, w, &[], 2, &mut y);
    assert_eq!(y, [0.0; 6]);
    let mut none: Vec<f32> = Vec::new();
    gemm_packed(&pool, w, &[], 0, &mut none);
}

/// Runs the test above again under each instruction set the machine has below its best, so the
/// AVX2 and scalar tiles are held to the same order.
#[test]
fn every_isa_gives_the_same_bits() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx2", "scalar"] {
        let status = std::process::Command::new(&exe)
            .args(["--exact", "every_output_is_the_documented_chain_whatever_the_batch_and_threads"])
            .env("KYLIN_KERNELS_ISA", cap)
            .status()
            .expect("spawn the test binary");
        assert!(status.success(), "gemm_packed differs with KYLIN_KERNELS_ISA={cap}");
    }
}
