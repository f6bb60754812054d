//! The BF16 matrix products (`Precision::Bf16`): accuracy against the f64 reference on odd
//! shapes, and batch invariance (every output row of a many-token call has the bits of that
//! token computed alone, on any thread count and grouping of matrices).
//!
//! On a machine without BF16 kernels the tests say so and check nothing else.

use kylin_kernels::bf16_tiles::{Bf16TileBuffer, matmul_many_bf16_tiles};
use kylin_kernels::{
    Bf16Kernels, ThreadPool, WeightDType, WeightMatrix, bf16_kernels, bf16_scratch_len, matmul_many_bf16, reference,
};

#[path = "support/rng.rs"]
mod rng;

use rng::Rng;

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

const ROWS: [usize; 7] = [1, 5, 16, 17, 31, 33, 97];
const COLS: [usize; 10] = [1, 2, 31, 32, 33, 64, 100, 1000, 2049, 3100];
// 1 and 2 tokens run one-row tiles, 3 and more six-row tiles (`avx512bf16::ONE_ROW_MAX_TOKENS`).
const TOKENS: [usize; 14] = [1, 2, 3, 4, 6, 7, 8, 15, 16, 17, 31, 33, 64, 100];

#[test]
fn bf16_matmul_matches_the_reference_and_is_batch_invariant() {
    let Some(kernels) = bf16_kernels() else {
        eprintln!("no BF16 kernels on this machine: nothing to check");
        return;
    };
    eprintln!("checking the {} kernels", kernels.name());
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for &rows in &ROWS {
        for &cols in &COLS {
            let data = rng.bf16_weights(rows * cols);
            let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
            let max_tokens = *TOKENS.iter().max().unwrap();
            let x = rng.vec(max_tokens * cols);
            // Room to start the scratch at every element of a cache line (below).
            let mut scratch = vec![0u16; bf16_scratch_len(max_tokens, cols) + 32];
            // Each token alone: the bits every batch must reproduce.
            let mut alone = vec![0.0f32; max_tokens * rows];
            for t in 0..max_tokens {
                let mut jobs = [(w, &mut alone[t * rows..(t + 1) * rows])];
                matmul_many_bf16(&pools[0], kernels, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut jobs);
            }
            // Accuracy: within f32 rounding of the f64 sum of the same BF16 products.
            let mut expected = vec![0.0f32; max_tokens * rows];
            reference::matmul_bf16(w, &x, max_tokens, &mut expected);
            for t in 0..max_tokens {
                for r in 0..rows {
                    let scale: f32 = (0..cols)
                        .map(|c| {
                            let xv = f32::from_bits((kylin_kernels::round_bf16(x[t * cols + c]) as u32) << 16);
                            (reference::load_f32(WeightDType::BF16, &data, r * cols + c) * xv).abs()
                        })
                        .sum();
                    let (got, want) = (alone[t * rows + r], expected[t * rows + r]);
                    assert!(
                        (got - want).abs() <= 1e-5 * scale + 1e-30,
                        "rows={rows} cols={cols} t={t} r={r}: got {got}, want {want} (scale {scale})"
                    );
                }
            }
            // Invariance: every batch size, on one and two threads, alone and beside another
            // matrix sharing the input.
            let other_data = rng.bf16_weights(7 * cols);
            let other = WeightMatrix { dtype: WeightDType::BF16, rows: 7, cols, data: &other_data };
            for &n in &TOKENS {
                for pool in &pools {
                    let mut y = vec![0.0f32; n * rows];
                    let mut y2 = vec![0.0f32; n * 7];
                    let mut jobs = [(other, &mut y2[..]), (w, &mut y[..])];
                    // The scratch starts `n % 32` elements in: the packed rows are aligned
                    // inside it wherever it starts, with the same bits.
                    matmul_many_bf16(pool, kernels, &x[..n * cols], n, &mut scratch[n % 32..], &mut jobs);
                    assert_eq!(
                        bits(&y),
                        bits(&alone[..n * rows]),
                        "rows={rows} cols={cols} n={n} threads={}: a batch changed some output's bits",
                        pool.threads()
                    );
                }
            }
        }
    }
}

/// Re-runs the test above with AMX turned off (`KYLIN_KERNELS_ISA=avx512`), so the AVX-512
/// BF16 kernels are checked too on a machine that has both.
#[test]
fn the_avx512_bf16_kernels_pass_the_same_checks() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        // Already a child (or the caller chose the kernels): the test above covers it.
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let output = std::process::Command::new(&exe)
        .args(["--exact", "bf16_matmul_matches_the_reference_and_is_batch_invariant", "--nocapture"])
        .env("KYLIN_KERNELS_ISA", "avx512")
        .output()
        .expect("spawn the test binary");
    assert!(output.status.success(), "the BF16 products fail with KYLIN_KERNELS_ISA=avx512: {output:?}");
}

/// Weights repacked into AMX tiles (`Bf16TileBuffer`) give every output the bits of the
/// row-major AMX product, for every batch size (decode's one-row token tiles, short and padded
/// token blocks, several super-blocks), on one and two threads, beside another tiled matrix;
/// and a tiled row reads back as the row it came from.
#[test]
fn tiled_bf16_weights_give_the_bits_of_the_row_major_product() {
    if bf16_kernels() != Some(Bf16Kernels::Amx) {
        eprintln!("no AMX on this machine: nothing to check");
        return;
    }
    let pools = [ThreadPool::new(1), ThreadPool::new(2)];
    let mut rng = Rng(0x51_7C_C1_B7_27_22_0A_95);
    for &(rows, cols) in &[(16usize, 32usize), (48, 64), (80, 1024), (112, 96), (1024, 3072)] {
        let data = rng.bf16_weights(rows * cols);
        let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
        let tiled = Bf16TileBuffer::new(w).expect("a tileable BF16 matrix on AMX");
        let mut row = vec![0.0f32; cols];
        for r in [0, 1, 15, rows / 2 + 3, rows - 1] {
            tiled.widen_row(r, &mut row);
            let want: Vec<f32> =
                (0..cols).map(|c| reference::load_f32(WeightDType::BF16, &data, r * cols + c)).collect();
            assert_eq!(bits(&row), bits(&want), "{rows}x{cols}: row {r} read back from the tiles");
        }
        let other_data = rng.bf16_weights(32 * cols);
        let other = WeightMatrix { dtype: WeightDType::BF16, rows: 32, cols, data: &other_data };
        let other_tiled = Bf16TileBuffer::new(other).expect("tileable");
        let tokens: &[usize] =
            if rows * cols > 1 << 20 { &[1, 2, 17, 40, 200] } else { &[1, 2, 5, 15, 16, 17, 33, 40, 100] };
        let max = *tokens.iter().max().unwrap();
        let x = rng.vec(max * cols);
        let mut scratch = vec![0u16; bf16_scratch_len(max, cols) + 32];
        for &n in tokens {
            let mut want = vec![0.0f32; n * rows];
            let mut want_other = vec![0.0f32; n * 32];
            let mut jobs = [(w, &mut want[..]), (other, &mut want_other[..])];
            matmul_many_bf16(&pools[0], Bf16Kernels::Amx, &x[..n * cols], n, &mut scratch, &mut jobs);
            for pool in &pools {
                let mut y = vec![f32::NAN; n * rows];
                let mut y_other = vec![f32::NAN; n * 32];
                let mut jobs = [(other_tiled.matrix(), &mut y_other[..]), (tiled.matrix(), &mut y[..])];
                matmul_many_bf16_tiles(pool, &x[..n * cols], n, &mut scratch[n % 32..], &mut jobs);
                let threads = pool.threads();
                assert_eq!(bits(&y), bits(&want), "{rows}x{cols}, {n} tokens, {threads} threads");
                assert_eq!(bits(&y_other), bits(&want_other), "32x{cols}, {n} tokens, {threads} threads");
            }
        }
    }
    // Not tileable: a row or column tail.
    for (rows, cols) in [(17usize, 32usize), (16, 48)] {
        let data = rng.bf16_weights(rows * cols);
        assert!(Bf16TileBuffer::new(WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data }).is_none());
    }
}

#[test]
fn rounding_to_bf16_is_to_nearest_even() {
    use kylin_kernels::round_bf16;
    assert_eq!(round_bf16(1.0), 0x3F80);
    // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
    assert_eq!(round_bf16(1.0 + 1.0 / 256.0), 0x3F80);
    // 1 + 3·2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6.
    assert_eq!(round_bf16(1.0 + 3.0 / 256.0), 0x3F82);
    assert_eq!(round_bf16(-2.5), 0xC020);
    assert_eq!(round_bf16(f32::MAX), 0x7F80, "the largest f32 rounds up to infinity");
    assert_eq!(round_bf16(f32::INFINITY), 0x7F80);
    let nan = round_bf16(f32::NAN);
    assert!(nan & 0x7F80 == 0x7F80 && nan & 0x7F != 0, "NaN stays NaN: {nan:#x}");
    for v in [0.1f32, -3.7, 1e-20, 65504.0, 123456.78] {
        assert_eq!(round_bf16(v), half::bf16::from_f32(v).to_bits(), "{v}");
    }
}

/// Throughput of the f32 and BF16 products on the shapes of a 0.6B model's layers (a measuring
/// aid, not a check): `cargo test --release -p kylin-kernels --test bf16 throughput --
/// --ignored --nocapture`.
#[test]
#[ignore]
fn throughput() {
    let Some(kernels) = bf16_kernels() else { return };
    let pool = ThreadPool::new(2);
    let mut rng = Rng(7);
    for (rows, cols) in [(3072usize, 1024usize), (1024, 3072), (2048, 1024)] {
        let data = rng.bf16_weights(rows * cols);
        let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
        for n in [1usize, 8, 64, 512] {
            let x = rng.vec(n * cols);
            let mut y = vec![0.0f32; n * rows];
            let mut scratch = vec![0u16; bf16_scratch_len(n, cols)];
            let reps = (2_000_000_000 / (rows * cols * n)).clamp(3, 2000);
            let tiled = (kernels == Bf16Kernels::Amx).then(|| Bf16TileBuffer::new(w)).flatten();
            let mut best = [f64::INFINITY; 3];
            for _ in 0..3 {
                if let Some(tiled) = &tiled {
                    let start = std::time::Instant::now();
                    for _ in 0..reps {
                        matmul_many_bf16_tiles(&pool, &x, n, &mut scratch, &mut [(tiled.matrix(), &mut y[..])]);
                    }
                    best[2] = best[2].min(start.elapsed().as_secs_f64() / reps as f64);
                }
                let start = std::time::Instant::now();
                for _ in 0..reps {
                    kylin_kernels::matmul(&pool, w, &x, n, &mut y);
                }
                best[0] = best[0].min(start.elapsed().as_secs_f64() / reps as f64);
                let start = std::time::Instant::now();
                for _ in 0..reps {
                    matmul_many_bf16(&pool, kernels, &x, n, &mut scratch, &mut [(w, &mut y[..])]);
                }
                best[1] = best[1].min(start.elapsed().as_secs_f64() / reps as f64);
            }
            let flop = 2.0 * (rows * cols * n) as f64;
            println!(
                "{rows}x{cols} n={n:4}: f32 {:8.1} GFLOP/s ({:.2} ms)  bf16 {:8.1} GFLOP/s ({:.2} ms)  weights {:.1} GB/s  tiled {:.1} GB/s ({:.2} ms)",
                flop / best[0] / 1e9,
                best[0] * 1e3,
                flop / best[1] / 1e9,
                best[1] * 1e3,
                (rows * cols * 2) as f64 / best[1] / 1e9,
                (rows * cols * 2) as f64 / best[2] / 1e9,
                best[2] * 1e3
            );
        }
    }
}
