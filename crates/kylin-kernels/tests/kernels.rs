//! Every dispatched kernel against the scalar reference, on odd sizes and for every dtype
//! (the matmul checks also under `KYLIN_KERNELS_ISA=avx2`).
//!
//! Matmul results may differ from the reference only by summation order, so each output is
//! compared with a tolerance of 1e-5 of `Σ|w·x|` (the scale of the rounding error of any
//! summation order); element-wise kernels that do the same operations must match exactly.

use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix, WeightVector, reference};

/// A small deterministic generator (xorshift64*), values in [-1, 1).
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let v = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40;
        v as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next_f32()).collect()
    }

    /// `n` values encoded as little-endian `dtype` bytes.
    fn weights(&mut self, dtype: WeightDType, n: usize) -> Vec<u8> {
        let mut out = Vec::with_capacity(n * dtype.size_in_bytes());
        for _ in 0..n {
            let v = self.next_f32();
            match dtype {
                WeightDType::F32 => out.extend_from_slice(&v.to_le_bytes()),
                WeightDType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
                WeightDType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
            }
        }
        out
    }
}

const DTYPES: [WeightDType; 3] = [WeightDType::BF16, WeightDType::F16, WeightDType::F32];

/// `Σ_c |w[r, c] · x[t, c]|` for every output, the scale of summation-order differences.
fn magnitudes(w: WeightMatrix<'_>, x: &[f32], n_tokens: usize) -> Vec<f32> {
    let mut out = vec![0.0; n_tokens * w.rows];
    for t in 0..n_tokens {
        for r in 0..w.rows {
            out[t * w.rows + r] = (0..w.cols)
                .map(|c| (reference::load_f32(w.dtype, w.data, r * w.cols + c) * x[t * w.cols + c]).abs())
                .sum();
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f32], scale: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for i in 0..got.len() {
        let tol = 1e-5 * scale[i] + 1e-30;
        assert!(
            (got[i] - want[i]).abs() <= tol,
            "{what}: element {i}: got {}, reference {} (tolerance {tol})",
            got[i],
            want[i]
        );
    }
}

fn check_matmul(pool: &ThreadPool, rng: &mut Rng, dtype: WeightDType, rows: usize, cols: usize, n_tokens: usize) {
    let data = rng.weights(dtype, rows * cols);
    let w = WeightMatrix { dtype, rows, cols, data: &data };
    let x = rng.vec(n_tokens * cols);
    let mut want = vec![0.0; n_tokens * rows];
    reference::matmul(pool, w, &x, n_tokens, &mut want);
    let mut got = vec![f32::NAN; n_tokens * rows];
    kylin_kernels::matmul(pool, w, &x, n_tokens, &mut got);
    let what = format!("matmul {dtype:?} rows={rows} cols={cols} tokens={n_tokens}");
    assert_close(&got, &want, &magnitudes(w, &x, n_tokens), &what);
}

#[test]
fn matmul_matches_reference_on_odd_sizes() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    for dtype in DTYPES {
        for cols in 1..=67 {
            for rows in [1, 3, 4, 5, 8, 23, 24, 25, 37] {
                for n_tokens in [1, 2, 3, 4, 5, 9] {
                    check_matmul(&pool, &mut rng, dtype, rows, cols, n_tokens);
                }
            }
        }
        for rows in 1..=37 {
            for n_tokens in 1..=9 {
                check_matmul(&pool, &mut rng, dtype, rows, 19, n_tokens);
            }
        }
    }
}

#[test]
fn matmul_matches_reference_across_panel_depth_and_threads() {
    // Columns beyond one packed panel depth (256), rows over several panels, enough work to
    // be split across threads, and 1..=3 threads.
    let mut rng = Rng(42);
    for threads in 1..=3 {
        let pool = ThreadPool::new(threads);
        for dtype in DTYPES {
            for (rows, cols, n_tokens) in [
                (50, 300, 9),
                (97, 513, 5),
                (200, 1024, 1),
                (200, 1024, 7),
                (75, 1000, 3),
                (97, 513, 40),
                (29, 3100, 9),
                (25, 1031, 300),
            ] {
                check_matmul(&pool, &mut rng, dtype, rows, cols, n_tokens);
            }
        }
    }
}

/// Re-runs the matmul checks above in a child process capped to AVX2 (on an AVX-512 machine),
/// so both SIMD GEMMs meet the reference.
#[test]
fn matmul_matches_reference_under_avx2() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let status = std::process::Command::new(exe)
        .args([
            "--exact",
            "matmul_matches_reference_on_odd_sizes",
            "matmul_matches_reference_across_panel_depth_and_threads",
            "matmul_many_matches_separate_references",
            "matmul_with_zero_columns_or_tokens",
        ])
        .env("KYLIN_KERNELS_ISA", "avx2")
        .status()
        .expect("spawn the test binary");
    assert!(status.success(), "matmul disagrees with the reference under KYLIN_KERNELS_ISA=avx2");
}

#[test]
fn matmul_with_zero_columns_or_tokens() {
    let pool = ThreadPool::new(2);
    for n_tokens in [0, 1, 5] {
        let w = WeightMatrix { dtype: WeightDType::BF16, rows: 3, cols: 0, data: &[] };
        let mut y = vec![f32::NAN; 3 * n_tokens];
        kylin_kernels::matmul(&pool, w, &[], n_tokens, &mut y);
        assert!(y.iter().all(|v| *v == 0.0));
    }
}

#[test]
fn matmul_many_matches_separate_references() {
    let pool = ThreadPool::new(2);
    let mut rng = Rng(7);
    for (cols, n_tokens) in [(33, 1), (64, 2), (130, 6), (1024, 1), (300, 17)] {
        // q/k/v-like: different row counts and dtypes sharing one input.
        let shapes = [(WeightDType::BF16, 37), (WeightDType::F16, 24), (WeightDType::F32, 5), (WeightDType::BF16, 130)];
        let datas: Vec<Vec<u8>> = shapes.iter().map(|(d, r)| rng.weights(*d, r * cols)).collect();
        let ws: Vec<WeightMatrix<'_>> =
            shapes.iter().zip(&datas).map(|((d, r), data)| WeightMatrix { dtype: *d, rows: *r, cols, data }).collect();
        let x = rng.vec(n_tokens * cols);
        let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![f32::NAN; n_tokens * w.rows]).collect();
        {
            let mut jobs: Vec<(WeightMatrix<'_>, &mut [f32])> =
                ws.iter().zip(ys.iter_mut()).map(|(w, y)| (*w, y.as_mut_slice())).collect();
            kylin_kernels::matmul_many(&pool, &x, n_tokens, &mut jobs);
        }
        for (w, y) in ws.iter().zip(&ys) {
            let mut want = vec![0.0; n_tokens * w.rows];
            reference::matmul(&pool, *w, &x, n_tokens, &mut want);
            assert_close(
                y,
                &want,
                &magnitudes(*w, &x, n_tokens),
                &format!("matmul_many {:?} rows={}", w.dtype, w.rows),
            );
        }
    }
}

#[test]
fn widen_row_is_exact() {
    let mut rng = Rng(3);
    for dtype in DTYPES {
        for cols in 1..=67 {
            let rows = 5;
            let data = rng.weights(dtype, rows * cols);
            let w = WeightMatrix { dtype, rows, cols, data: &data };
            for row in 0..rows {
                let mut want = vec![0.0; cols];
                let mut got = vec![f32::NAN; cols];
                reference::widen_row(w, row, &mut want);
                kylin_kernels::widen_row(w, row, &mut got);
                assert_eq!(got, want, "{dtype:?} cols={cols} row={row}");
            }
        }
    }
}

/// Both RMSNorms (`w` and Gemma's `1 + w`) against their references.
#[test]
fn rms_norm_matches_reference() {
    type Norm = fn(&[f32], WeightVector<'_>, f32, &mut [f32]);
    let pairs: [(&str, Norm, Norm); 2] = [
        ("rms_norm", reference::rms_norm, kylin_kernels::rms_norm),
        ("rms_norm_unit_offset", reference::rms_norm_unit_offset, kylin_kernels::rms_norm_unit_offset),
    ];
    let mut rng = Rng(5);
    for (what, reference, kernel) in pairs {
        for dtype in DTYPES {
            for n in 1..=67 {
                let x = rng.vec(n);
                let wdata = rng.weights(dtype, n);
                let weight = WeightVector { dtype, data: &wdata };
                let mut want = vec![0.0; n];
                let mut got = vec![0.0; n];
                reference(&x, weight, 1e-6, &mut want);
                kernel(&x, weight, 1e-6, &mut got);
                // Only the sum of squares is reordered: a few ulp.
                for i in 0..n {
                    assert!(
                        (got[i] - want[i]).abs() <= 1e-6 * want[i].abs().max(1e-3),
                        "{what} {dtype:?} n={n} i={i}: {} vs {}",
                        got[i],
                        want[i]
                    );
                }
            }
        }
    }
}

/// GeGLU and soft-capping: the SIMD tanh (`1 − 2 / (e^{2u} + 1)` over the kernels' `exp`)
/// against `f32::tanh`, on odd lengths and extreme inputs; and every element's bits independent
/// of where the slice ends (the tail runs the vector code, for batch invariance).
#[test]
fn gelu_tanh_and_softcap_match_reference_and_ignore_the_slice_end() {
    let mut rng = Rng(19);
    for n in 1..=67 {
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 12.0).collect();
        let y = rng.vec(n);
        let (mut a, mut b) = (x.clone(), x.clone());
        reference::gelu_tanh_mul(&mut a, &y);
        kylin_kernels::gelu_tanh_mul(&mut b, &y);
        for (i, (g, w)) in b.iter().zip(&a).enumerate() {
            // tanh near 0 comes from 1 - 2/(e^2u + 1): absolute error about 1e-7 of x.
            let tol = 1e-6 * w.abs() + 2e-7 * x[i].abs() * y[i].abs() + 1e-30;
            assert!((g - w).abs() <= tol, "gelu_tanh_mul n={n} i={i}: {g} vs {w}");
        }
        let mut whole = x.clone();
        kylin_kernels::gelu_tanh_mul(&mut whole, &y);
        for cut in 1..n {
            let mut head = x[..cut].to_vec();
            kylin_kernels::gelu_tanh_mul(&mut head, &y[..cut]);
            assert!(head.iter().zip(&whole).all(|(p, q)| p.to_bits() == q.to_bits()), "gelu_tanh_mul n={n} cut={cut}");
        }
        for cap in [0.5f32, 30.0, 50.0] {
            let (mut a, mut b) = (x.clone(), x.clone());
            reference::softcap(&mut a, cap);
            kylin_kernels::softcap(&mut b, cap);
            for (i, (g, w)) in b.iter().zip(&a).enumerate() {
                assert!((g - w).abs() <= 2e-6 * cap, "softcap {cap} n={n} i={i}: {g} vs {w}");
            }
            let mut head = x[..n / 2].to_vec();
            kylin_kernels::softcap(&mut head, cap);
            assert!(head.iter().zip(&b).all(|(p, q)| p.to_bits() == q.to_bits()), "softcap {cap} n={n}");
        }
    }
    let mut extremes = vec![-1e6f32, -100.0, -1e-20, 0.0, 1e-20, 100.0, 1e6];
    kylin_kernels::softcap(&mut extremes, 30.0);
    assert!(extremes.iter().all(|v| v.is_finite() && v.abs() <= 30.0), "{extremes:?}");
    let mut g = vec![-1e4f32, -20.0, 0.0, 20.0, 1e4];
    kylin_kernels::gelu_tanh_mul(&mut g, &[1.0; 5]);
    assert_eq!(g, [-0.0, -0.0, 0.0, 20.0, 1e4], "gelu saturates to 0 and x");
}

#[test]
fn elementwise_kernels_match_reference_exactly() {
    let mut rng = Rng(11);
    for n in 1..=67 {
        let x = rng.vec(n);
        let y = rng.vec(n);
        for dtype in DTYPES {
            let bdata = rng.weights(dtype, n);
            let bias = WeightVector { dtype, data: &bdata };
            let (mut a, mut b) = (x.clone(), x.clone());
            reference::add_bias(&mut a, bias);
            kylin_kernels::add_bias(&mut b, bias);
            assert_eq!(a, b, "add_bias {dtype:?} n={n}");
        }
        let (mut a, mut b) = (x.clone(), x.clone());
        reference::add_assign(&mut a, &y);
        kylin_kernels::add_assign(&mut b, &y);
        assert_eq!(a, b, "add_assign n={n}");

        let half = n / 2;
        let cos = rng.vec(half);
        let sin = rng.vec(half);
        let (mut a, mut b) = (x.clone(), x.clone());
        reference::rope_rotate_half(&mut a, &cos, &sin);
        kylin_kernels::rope_rotate_half(&mut b, &cos, &sin);
        assert_eq!(a, b, "rope n={n}");
    }
}

/// `|got - want| <= ulps` units in the last place of `want` (plus a floor for values near 0).
fn assert_ulps(got: &[f32], want: &[f32], ulps: f32, what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let tol = ulps * f32::EPSILON * w.abs().max(1e-30);
        assert!((g - w).abs() <= tol, "{what} i={i}: {g} vs {w}");
    }
}

#[test]
fn softmax_and_silu_match_reference_within_a_few_ulp() {
    // Only `exp` differs (a polynomial within 2 ulp of libm's), so each output is within a few
    // ulp; inputs span the whole range either kernel meets, saturation included.
    let mut rng = Rng(17);
    for n in (1..=67).chain([151_936]) {
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 40.0).collect();
        let y = rng.vec(n);
        let mut b = x.clone();
        kylin_kernels::softmax(&mut b);
        if n <= 67 {
            // Same f32 differences `x - max`, another exp and summation order: a few ulp.
            let mut a = x.clone();
            reference::softmax(&mut a);
            let top = a.iter().copied().fold(0.0f32, f32::max);
            for (i, (g, w)) in b.iter().zip(&a).enumerate() {
                let tol = 8.0 * f32::EPSILON * w.max(top * 1e-6);
                assert!((g - w).abs() <= tol, "softmax n={n} i={i}: {g} vs {w}");
            }
        } else {
            // A whole vocabulary: against the exact (f64) values, since a sequential f32 sum
            // of 150k terms (the reference's) is itself off by about 1e-5.
            let max = x.iter().copied().fold(f64::NEG_INFINITY, |m, v| m.max(v as f64));
            let total: f64 = x.iter().map(|&v| (v as f64 - max).exp()).sum();
            for (i, (g, v)) in b.iter().zip(&x).enumerate() {
                let exact = (*v as f64 - max).exp() / total;
                assert!((*g as f64 - exact).abs() <= 1e-5 * exact + 1e-30, "softmax n={n} i={i}: {g} vs {exact}");
            }
        }
        let (mut a, mut b) = (x.clone(), x.clone());
        reference::silu_mul(&mut a, &y);
        kylin_kernels::silu_mul(&mut b, &y);
        assert_ulps(&b, &a, 6.0, &format!("silu_mul n={n}"));
        let (mut a, mut b) = (x.clone(), x.clone());
        reference::silu(&mut a);
        kylin_kernels::silu(&mut b);
        assert_ulps(&b, &a, 6.0, &format!("silu n={n}"));
    }
    let mut extremes = vec![-1e4f32, -100.0, -88.0, -87.0, 0.0, 87.0, 88.0, 100.0, 1e4];
    let mut reference_copy = extremes.clone();
    reference::softmax(&mut reference_copy);
    kylin_kernels::softmax(&mut extremes);
    assert!(extremes.iter().all(|v| v.is_finite()), "{extremes:?}");
    assert_ulps(&extremes[6..], &reference_copy[6..], 8.0, "softmax extremes");
}

#[test]
fn attention_head_matches_reference() {
    let mut rng = Rng(13);
    for head_dim in [1, 7, 8, 31, 64, 67, 128] {
        for len in 1..=9 {
            let q = rng.vec(head_dim);
            let keys = rng.vec(len * head_dim);
            let values = rng.vec(len * head_dim);
            let scale = 1.0 / (head_dim as f32).sqrt();
            let (mut s1, mut s2) = (vec![0.0; len + 3], vec![0.0; len + 3]);
            let (mut want, mut got) = (vec![0.0; head_dim], vec![f32::NAN; head_dim]);
            reference::attention_head(&q, &keys, &values, len, head_dim, scale, &mut s1, &mut want);
            kylin_kernels::attention_head(&q, &keys, &values, len, head_dim, scale, &mut s2, &mut got);
            // Scores are dot products in another order, so allow a few ulp of |values| (<= 1).
            for i in 0..head_dim {
                assert!(
                    (got[i] - want[i]).abs() <= 1e-5,
                    "head_dim={head_dim} len={len} i={i}: {} vs {}",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

#[test]
fn read_bandwidth_is_positive() {
    let pool = ThreadPool::new(2);
    let gb_s = kylin_kernels::measure_read_bandwidth(&pool, 1 << 20, 3);
    assert!(gb_s.is_finite() && gb_s > 0.0, "{gb_s}");
    assert_eq!(kylin_kernels::measure_read_bandwidth(&pool, 0, 3), 0.0);
}
