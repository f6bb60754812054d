//! Q8_0: the weight quantization against GGUF's definition, the packed layout round trip, and
//! the int8 products against an independent implementation of the canonical order (bit for
//! bit, on every instruction set), against f64 (the quantization error only), and every token's
//! outputs equal to the token computed alone.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::quant::{
    Packing, Q8Matrix, QK8_0, QuantBuffer, dequantize_row_q8_0, matmul_many_q8, pack_q8_0, q8_0_plane_lens,
    q8_scratch_len, quantize_activations, quantize_q8_0_groups, quantize_row_q8_0, row_q8_0,
};
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix};
use rng::Rng;

/// GGUF's Q8_0 of one block, written from llama.cpp's `quantize_row_q8_0_ref` in f64 where it
/// does not matter and f32 where it does.
fn gguf_block(x: &[f32]) -> (Vec<i8>, u16) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d: f32 = amax / ((1 << 7) - 1) as f32;
    let id: f32 = if d == 0.0 { 0.0 } else { 1.0 / d };
    (x.iter().map(|v| (v * id).round() as i8).collect(), half::f16::from_f32(d).to_bits())
}

fn packed(rng: &mut Rng, dtype: WeightDType, rows: usize, cols: usize) -> (Vec<u8>, QuantBuffer) {
    let source = rng.weights(dtype, rows * cols);
    let w = WeightMatrix { dtype, rows, cols, data: &source };
    let mut out = QuantBuffer::zeroed(Packing::Q8_0, rows, cols).expect("cols are a multiple of 32");
    let groups = rows.div_ceil(16);
    let mut row = vec![0.0; cols];
    // Two calls over split group ranges, as the engine quantizes in parallel.
    let half = groups / 2;
    let (quants, scales) = out.planes_mut();
    let (qa, qb) = quants.split_at_mut(half * (cols / QK8_0) * 512);
    let (sa, sb) = scales.split_at_mut(half * (cols / QK8_0) * 32);
    quantize_q8_0_groups(w, 0..half, qa, sa, &mut row);
    quantize_q8_0_groups(w, half..groups, qb, sb, &mut row);
    (source, out)
}

#[test]
fn quantization_is_ggufs_and_the_layout_round_trips() {
    let mut rng = Rng(7);
    for dtype in [WeightDType::BF16, WeightDType::F16, WeightDType::F32] {
        for (rows, cols) in [(1, 32), (5, 64), (16, 96), (17, 576), (37, 128)] {
            let (source, data) = packed(&mut rng, dtype, rows, cols);
            let m = data.matrix().as_q8_0().expect("q8_0");
            let w = WeightMatrix { dtype, rows, cols, data: &source };
            let (mut qs, mut scales, mut deq, mut row) =
                (vec![0i8; cols], vec![0u16; cols / 32], vec![0.0f32; cols], vec![0.0f32; cols]);
            for r in 0..rows {
                kylin_kernels::widen_row(w, r, &mut row);
                row_q8_0(m, r, &mut qs, &mut scales);
                dequantize_row_q8_0(m, r, &mut deq);
                for b in 0..cols / 32 {
                    let (q, d) = gguf_block(&row[b * 32..(b + 1) * 32]);
                    assert_eq!(&qs[b * 32..(b + 1) * 32], &q[..], "{dtype:?} {rows}x{cols} row {r} block {b}");
                    assert_eq!(scales[b], d, "{dtype:?} {rows}x{cols} row {r} block {b} scale");
                    let d = half::f16::from_bits(d).to_f32();
                    for k in 0..32 {
                        assert_eq!(deq[b * 32 + k], d * q[k] as f32);
                        // Rounding to the nearest step, plus the f16 rounding of the step.
                        let err = (deq[b * 32 + k] - row[b * 32 + k]).abs();
                        assert!(err <= 0.5 * d + 127.0 * d * 1e-3 + 1e-30, "error {err} step {d}");
                    }
                }
            }
            // The same function on the same numbers gives the same quants (the helper above
            // re-derives them; here the library's own row function agrees with itself).
            let mut q2 = vec![0i8; cols];
            let mut s2 = vec![0u16; cols / 32];
            kylin_kernels::widen_row(w, rows - 1, &mut row);
            quantize_row_q8_0(&row, &mut q2, &mut s2);
            row_q8_0(m, rows - 1, &mut qs, &mut scales);
            assert_eq!((q2, s2), (qs.clone(), scales.clone()));
        }
    }
    // Exact ties (amax 127 makes the step exactly 1) round half away from zero, as GGUF's
    // `roundf`; a block of zeros has the scale 0 and zero quants.
    let mut x = vec![0.0f32; 96];
    x[..8].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 125.5]);
    x[32..37].copy_from_slice(&[-127.0, 0.499_999_97, -0.499_999_97, 64.5, -0.0]);
    let (mut q, mut s) = (vec![0i8; 96], vec![0u16; 3]);
    quantize_row_q8_0(&x, &mut q, &mut s);
    for b in 0..3 {
        let (gq, gd) = gguf_block(&x[b * 32..(b + 1) * 32]);
        assert_eq!((&q[b * 32..(b + 1) * 32], s[b]), (&gq[..], gd), "block {b} of the ties");
    }
    assert_eq!(&q[..8], &[127, 3, -4, 1, -1, 2, -127, 126]);
    // Invalid views are refused.
    assert!(Q8Matrix::new(3, 33, &[0; 0], &[0; 0]).is_none());
    assert!(Q8Matrix::new(3, 32, &[0; 511], &[0; 32]).is_none());
    assert!(Q8Matrix::new(3, 32, &[0; 512], &[0; 32]).is_some());
    assert_eq!(q8_0_plane_lens(3, 31), None);
    assert_eq!(q8_0_plane_lens(17, 64), Some((2 * 2 * 512, 2 * 2 * 32)));
    assert!(QuantBuffer::zeroed(Packing::Q8_0, usize::MAX / 2, 64).is_none());
}

/// The activation quantization of the module docs: per block `d = f16(amax / 127)`, `q =
/// round_ties_even(x · 127 / amax)` (0 when `d` is 0), and `−128 · Σq`.
fn activations(x: &[f32]) -> Vec<(Vec<i32>, f32)> {
    x.chunks_exact(32)
        .map(|block| {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = half::f16::from_f32(amax / 127.0).to_f32();
            let id = if d != 0.0 { 127.0 / amax } else { 0.0 };
            (block.iter().map(|v| (v * id).round_ties_even() as i32).collect(), d)
        })
        .collect()
}

/// The canonical order, written independently of the library: exact integer block sums,
/// `acc = fma(isum, dx · dw, acc)` block by block.
fn canonical(m: Q8Matrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (m.rows(), m.cols());
    let (mut qs, mut scales) = (vec![0i8; cols], vec![0u16; cols / 32]);
    let mut y = vec![0.0f32; n * rows];
    for t in 0..n {
        let xa = activations(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            row_q8_0(m, r, &mut qs, &mut scales);
            let mut acc = 0.0f32;
            for (b, (xq, dx)) in xa.iter().enumerate() {
                let isum: i32 = (0..32).map(|k| qs[b * 32 + k] as i32 * xq[k]).sum();
                acc = (isum as f32).mul_add(dx * half::f16::from_bits(scales[b]).to_f32(), acc);
            }
            y[t * rows + r] = acc;
        }
    }
    y
}

#[test]
fn activation_quantization_matches_its_definition() {
    let mut rng = Rng(11);
    for cols in [32, 96, 1024] {
        let n = 3;
        let mut x = rng.vec(n * cols);
        x[5] = 0.0;
        // A block of zeros and a block with exact ties.
        let len = x.len();
        x[32..64.min(len)].fill(0.0);
        if cols >= 96 {
            // amax 127 makes the step exactly 1: x.5 values are ties, rounded to even.
            let ties = [127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 125.5];
            x[64..72].copy_from_slice(&ties);
        }
        let mut out = vec![0u8; q8_scratch_len(n, cols)];
        quantize_activations(&x, n, cols, &mut out);
        let stride = cols + 8 * (cols / 32);
        for t in 0..n {
            let row = &out[t * stride..(t + 1) * stride];
            for (b, (q, d)) in activations(&x[t * cols..(t + 1) * cols]).iter().enumerate() {
                let got: Vec<i32> = row[b * 32..(b + 1) * 32].iter().map(|&v| v as i8 as i32).collect();
                assert_eq!(&got, q, "cols {cols} token {t} block {b}");
                let nb = cols / 32;
                let gd = f32::from_le_bytes(row[cols + 4 * b..cols + 4 * b + 4].try_into().unwrap());
                let gc = i32::from_le_bytes(row[cols + 4 * nb + 4 * b..cols + 4 * nb + 4 * b + 4].try_into().unwrap());
                assert_eq!(gd.to_bits(), d.to_bits());
                assert_eq!(gc, -128 * q.iter().sum::<i32>());
            }
        }
    }
}

#[test]
fn products_have_the_canonical_bits_and_the_expected_accuracy() {
    let mut rng = Rng(3);
    for (rows, cols) in [(1, 32), (7, 64), (16, 96), (33, 576), (50, 1024), (150, 64)] {
        let (_, data) = packed(&mut rng, WeightDType::BF16, rows, cols);
        let m = data.matrix().as_q8_0().expect("q8_0");
        for n in [1, 2, 5, 8, 9, 19] {
            let x = rng.vec(n * cols);
            let expected = canonical(m, &x, n);
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mut scratch = vec![0u8; q8_scratch_len(n, cols)];
                let mut y = vec![f32::NAN; n * rows];
                matmul_many_q8(&pool, &x, n, &mut scratch, &mut [(m, &mut y)]);
                let same = y.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rows}x{cols} n={n} threads={threads}: {y:?} != {expected:?}");
            }
            // Against the dequantized weights and f32 activations in f64: only the activations'
            // quantization separates them (half a step per element at most).
            let mut deq = vec![0.0f32; cols];
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                for r in 0..rows {
                    dequantize_row_q8_0(m, r, &mut deq);
                    let exact: f64 = deq.iter().zip(xt).map(|(w, x)| *w as f64 * *x as f64).sum();
                    let bound: f64 = xt
                        .chunks_exact(32)
                        .zip(deq.chunks_exact(32))
                        .map(|(xb, wb)| {
                            let step = xb.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 127.0;
                            wb.iter().map(|w| w.abs() as f64).sum::<f64>() * step * 0.5001
                        })
                        .sum::<f64>()
                        + 1e-5 * deq.iter().zip(xt).map(|(w, x)| (*w as f64 * *x as f64).abs()).sum::<f64>();
                    let got = expected[t * rows + r] as f64;
                    assert!(
                        (got - exact).abs() <= bound,
                        "{rows}x{cols} t={t} r={r}: {got} vs {exact} (bound {bound})"
                    );
                }
            }
        }
    }
}

#[test]
fn fused_matrices_and_lone_tokens_agree() {
    let mut rng = Rng(5);
    let cols = 160;
    let (_, a) = packed(&mut rng, WeightDType::F16, 40, cols);
    let (_, b) = packed(&mut rng, WeightDType::BF16, 9, cols);
    let (ma, mb) = (a.matrix().as_q8_0().expect("q8_0"), b.matrix().as_q8_0().expect("q8_0"));
    let pool = ThreadPool::new(2);
    let n = 21;
    let x = rng.vec(n * cols);
    let mut scratch = vec![0u8; q8_scratch_len(n, cols)];
    let (mut ya, mut yb) = (vec![0.0; n * 40], vec![0.0; n * 9]);
    matmul_many_q8(&pool, &x, n, &mut scratch, &mut [(ma, &mut ya), (mb, &mut yb)]);
    for t in 0..n {
        let (mut la, mut lb) = (vec![0.0; 40], vec![0.0; 9]);
        matmul_many_q8(&pool, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut [(ma, &mut la)]);
        matmul_many_q8(&pool, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut [(mb, &mut lb)]);
        assert!(la.iter().zip(&ya[t * 40..(t + 1) * 40]).all(|(p, q)| p.to_bits() == q.to_bits()), "token {t}");
        assert!(lb.iter().zip(&yb[t * 9..(t + 1) * 9]).all(|(p, q)| p.to_bits() == q.to_bits()), "token {t}");
    }
}

/// A published int8 checkpoint (compressed-tensors W8A8) uses all of `[-128, 127]`, where
/// Kylin's own quantization stops at -127: the products of a matrix packed from such integers
/// (every block holding -128, against activations of both signs) have the canonical bits.
#[test]
fn published_int8_weights_with_minus_128_have_the_canonical_bits() {
    let mut rng = Rng(23);
    let (rows, cols, n) = (21, 96, 5);
    let q: Vec<i8> =
        (0..rows * cols).map(|i| if i % 7 == 0 { -128 } else { ((rng.next_u64() % 256) as i32 - 128) as i8 }).collect();
    let scales: Vec<f32> = (0..rows * cols / QK8_0).map(|i| 1e-3 * (1.0 + (i % 5) as f32)).collect();
    let mut buffer = QuantBuffer::zeroed(Packing::Q8_0, rows, cols).expect("cols are a multiple of 32");
    let (quants, planes) = buffer.planes_mut();
    pack_q8_0(rows, cols, &q, &scales, quants, planes);
    let m = buffer.matrix().as_q8_0().expect("q8_0");
    let x = rng.vec(n * cols);
    let pool = ThreadPool::new(2);
    let mut scratch = vec![0u8; q8_scratch_len(n, cols)];
    let mut y = vec![0.0; n * rows];
    matmul_many_q8(&pool, &x, n, &mut scratch, &mut [(m, &mut y)]);
    let want = canonical(m, &x, n);
    for (i, (a, b)) in y.iter().zip(&want).enumerate() {
        assert_eq!(a.to_bits(), b.to_bits(), "output {i}: {a} against the canonical {b}");
    }
}

/// Re-runs the tests above in a child process under every instruction set this machine can be
/// capped to, so the AVX2 and scalar paths give the canonical bits too.
#[test]
fn every_isa_gives_the_canonical_bits() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx2", "scalar"] {
        for test in [
            "quantization_is_ggufs_and_the_layout_round_trips",
            "activation_quantization_matches_its_definition",
            "products_have_the_canonical_bits_and_the_expected_accuracy",
            "fused_matrices_and_lone_tokens_agree",
            "published_int8_weights_with_minus_128_have_the_canonical_bits",
        ] {
            let status = std::process::Command::new(&exe)
                .args(["--exact", test])
                .env("KYLIN_KERNELS_ISA", cap)
                .status()
                .expect("spawn the test binary");
            assert!(status.success(), "{test} fails with KYLIN_KERNELS_ISA={cap}");
        }
    }
}
