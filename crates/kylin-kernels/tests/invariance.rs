//! Batch invariance (DESIGN.md invariant 7): every output row of `matmul`, `matmul_many` and
//! `matmul_rows` is bit for bit the row computed for that token alone (`n_tokens = 1`),
//! whatever the batch size, the token's position in the batch, the thread count and the
//! grouping of matrices.
//!
//! The checks run under the instruction set detected for this process; a second test re-runs
//! this test binary with `KYLIN_KERNELS_ISA=avx2` and `KYLIN_KERNELS_ISA=scalar`, so every
//! kernel path the machine has is checked.

use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix};

#[path = "support/rng.rs"]
mod rng;

use rng::Rng;

const DTYPES: [WeightDType; 3] = [WeightDType::BF16, WeightDType::F16, WeightDType::F32];
const ROWS: [usize; 6] = [1, 5, 23, 24, 25, 97];
const COLS: [usize; 11] = [1, 7, 8, 31, 32, 33, 100, 257, 1000, 1031, 3100];
/// Distinct token vectors per shape; batches pick from them at shifting positions.
const POOL_TOKENS: usize = 67;

/// Batch sizes to check for a shape: all of 1..=40 and some larger ones (513, past every token
/// block, only where it is cheap). The widest rows (beyond the GEMM's f32 panel) get fewer.
fn batch_sizes(rows: usize, cols: usize) -> Vec<usize> {
    if cols > 2000 {
        return vec![1, 2, 3, 4, 5, 7, 8, 9, 13, 40, 100, 171];
    }
    let mut sizes: Vec<usize> = (1..=40).chain([64, 100]).collect();
    if rows * cols <= 25 * 1031 {
        sizes.push(513);
    }
    sizes
}

/// Token `i` of batch `n`: a different arrangement of the pool for every batch size, so one
/// token lands at many positions.
fn token_of(n: usize, i: usize) -> usize {
    (i * 7 + n * 3) % POOL_TOKENS
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// The output rows of each pool token computed alone.
fn singles(pool: &ThreadPool, w: WeightMatrix<'_>, tokens: &[f32]) -> Vec<Vec<u32>> {
    (0..POOL_TOKENS)
        .map(|i| {
            let mut y = vec![f32::NAN; w.rows];
            kylin_kernels::matmul(pool, w, &tokens[i * w.cols..(i + 1) * w.cols], 1, &mut y);
            bits(&y)
        })
        .collect()
}

/// `(n_tokens, cols)` batch `n` gathered from the pool.
fn batch(tokens: &[f32], cols: usize, n: usize) -> Vec<f32> {
    let mut x = Vec::with_capacity(n * cols);
    for i in 0..n {
        let k = token_of(n, i);
        x.extend_from_slice(&tokens[k * cols..(k + 1) * cols]);
    }
    x
}

fn assert_rows_match(y: &[f32], rows: usize, n: usize, alone: &[Vec<u32>], what: &str) {
    for i in 0..n {
        let got = bits(&y[i * rows..(i + 1) * rows]);
        let want = &alone[token_of(n, i)];
        if got != *want {
            let r = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
            panic!(
                "{what} n_tokens={n}: token {i} row {r}: {} in the batch, {} alone",
                f32::from_bits(got[r]),
                f32::from_bits(want[r])
            );
        }
    }
}

#[test]
fn matmul_is_batch_invariant() {
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut rng = Rng(0x5EED_0F1A);
    for dtype in DTYPES {
        for cols in COLS {
            let tokens = rng.vec(POOL_TOKENS * cols);
            for rows in ROWS {
                let data = rng.weights(dtype, rows * cols);
                let w = WeightMatrix { dtype, rows, cols, data: &data };
                let alone = singles(&pools[0], w, &tokens);
                for n in batch_sizes(rows, cols) {
                    let x = batch(&tokens, cols, n);
                    let pool = &pools[n % 3];
                    let mut y = vec![f32::NAN; n * rows];
                    kylin_kernels::matmul(pool, w, &x, n, &mut y);
                    let what = format!("matmul {dtype:?} {rows}x{cols} threads={}", pool.threads());
                    assert_rows_match(&y, rows, n, &alone, &what);
                }
            }
        }
    }
}

#[test]
fn matmul_many_is_batch_invariant() {
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut rng = Rng(0x0B47_C4ED);
    for cols in COLS {
        let tokens = rng.vec(POOL_TOKENS * cols);
        // q/k/v-like and gate/up-like groups: several dtypes and row counts sharing one input.
        let shapes = [(WeightDType::BF16, 97), (WeightDType::F16, 24), (WeightDType::F32, 5), (WeightDType::BF16, 25)];
        let datas: Vec<Vec<u8>> = shapes.iter().map(|(d, r)| rng.weights(*d, r * cols)).collect();
        let ws: Vec<WeightMatrix<'_>> =
            shapes.iter().zip(&datas).map(|((d, r), data)| WeightMatrix { dtype: *d, rows: *r, cols, data }).collect();
        let alone: Vec<Vec<Vec<u32>>> = ws.iter().map(|w| singles(&pools[0], *w, &tokens)).collect();
        for n in batch_sizes(97, cols) {
            let x = batch(&tokens, cols, n);
            for pool in &pools {
                let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n * w.rows]).collect();
                {
                    let mut jobs: Vec<(WeightMatrix<'_>, &mut [f32])> =
                        ws.iter().zip(ys.iter_mut()).map(|(w, y)| (*w, y.as_mut_slice())).collect();
                    kylin_kernels::matmul_many(pool, &x, n, &mut jobs);
                }
                for ((w, y), alone) in ws.iter().zip(&ys).zip(&alone) {
                    let what = format!("matmul_many {:?} {}x{cols} threads={}", w.dtype, w.rows, pool.threads());
                    assert_rows_match(y, w.rows, n, alone, &what);
                }
            }
        }
    }
}

/// `matmul_rows` (one token per matrix, each reading its own row of the input: a decode step's
/// routed experts' down products) gives every matrix the bits of `matmul` over its row alone,
/// with more matrices than one pool job takes (two jobs), rows read twice, and on 1–3 threads.
#[test]
fn matmul_rows_matches_each_row_alone() {
    let pools: Vec<ThreadPool> = (1..=3).map(ThreadPool::new).collect();
    let mut rng = Rng(0x0D0E_5EED);
    for cols in [7, 33, 257, 1031] {
        let inputs = 6;
        let xs = rng.vec(inputs * cols);
        let shapes = [
            (WeightDType::BF16, 97),
            (WeightDType::F16, 24),
            (WeightDType::F32, 5),
            (WeightDType::BF16, 25),
            (WeightDType::BF16, 1),
            (WeightDType::F32, 23),
            (WeightDType::F16, 40),
            (WeightDType::BF16, 64),
            (WeightDType::BF16, 33),
            (WeightDType::F16, 7),
        ];
        let datas: Vec<Vec<u8>> = shapes.iter().map(|(d, r)| rng.weights(*d, r * cols)).collect();
        let ws: Vec<WeightMatrix<'_>> =
            shapes.iter().zip(&datas).map(|((d, r), data)| WeightMatrix { dtype: *d, rows: *r, cols, data }).collect();
        // Matrix i reads row (5i + 3) mod 6: rows 3, 2, 1, 0, 5, 4, 3, ...
        let row_of = |i: usize| (5 * i + 3) % inputs;
        let alone: Vec<Vec<u32>> = ws
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let mut y = vec![f32::NAN; w.rows];
                kylin_kernels::matmul(&pools[0], *w, &xs[row_of(i) * cols..(row_of(i) + 1) * cols], 1, &mut y);
                bits(&y)
            })
            .collect();
        for pool in &pools {
            let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; w.rows]).collect();
            {
                let mut jobs: Vec<(kylin_kernels::FloatRowInput<'_>, &mut [f32])> = ws
                    .iter()
                    .zip(ys.iter_mut())
                    .enumerate()
                    .map(|(i, (w, y))| (kylin_kernels::FloatRowInput { matrix: *w, row: row_of(i) }, y.as_mut_slice()))
                    .collect();
                kylin_kernels::matmul_rows(pool, &xs, &mut jobs);
            }
            for (i, (y, want)) in ys.iter().zip(&alone).enumerate() {
                assert_eq!(
                    bits(y),
                    *want,
                    "matmul_rows matrix {i} ({:?} {}x{cols}) threads={}",
                    ws[i].dtype,
                    ws[i].rows,
                    pool.threads()
                );
            }
        }
    }
}

/// Re-runs the three tests above in a child process for every instruction set this machine can
/// be capped to, so the AVX2 and scalar paths are held to the same invariant as the default.
#[test]
fn every_isa_is_batch_invariant() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        // Already a child (or the caller chose one ISA): the three tests above cover it.
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx2", "scalar"] {
        let status = std::process::Command::new(&exe)
            .args([
                "--exact",
                "matmul_is_batch_invariant",
                "matmul_many_is_batch_invariant",
                "matmul_rows_matches_each_row_alone",
                "--test-threads=2",
            ])
            .env("KYLIN_KERNELS_ISA", cap)
            .status()
            .expect("spawn the test binary");
        assert!(status.success(), "batch invariance fails with KYLIN_KERNELS_ISA={cap}");
    }
}
