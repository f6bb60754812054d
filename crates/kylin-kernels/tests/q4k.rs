//! Q4_K: the weight quantization against llama.cpp's own output (a GGUF file's blocks), the
//! packed layout round trip (partial super-blocks included), and the integer products against
//! an independent implementation of the canonical order (bit for bit, on every instruction
//! set), against f64 (the activations' quantization error only), and every token's outputs
//! equal to the token computed alone.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::q4k::{
    GGUF_BLOCK_BYTES, Q4KMatrix, QK_K, SuperBlock, matmul_many_q4k, matmul_q4k_scalar, q4_k_plane_lens,
    q4k_scratch_len, quantize_activations, quantize_row_q4_k_gguf, quantize_super_block, super_block_q4_k,
};
use kylin_kernels::quant::{Packing, QuantBuffer};
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix};
use rng::Rng;

fn packed(rng: &mut Rng, dtype: WeightDType, rows: usize, cols: usize) -> (Vec<u8>, QuantBuffer) {
    let source = rng.weights(dtype, rows * cols);
    let w = WeightMatrix { dtype, rows, cols, data: &source };
    let mut out = QuantBuffer::zeroed(Packing::Q4K, rows, cols).expect("cols are a multiple of 64");
    let groups = rows.div_ceil(16);
    let (gq, gs) = out.group_bytes();
    let mut row = vec![0.0; cols];
    // Two calls over split group ranges, as the engine quantizes in parallel.
    let half = groups / 2;
    let (quants, scales) = out.planes_mut();
    let (qa, qb) = quants.split_at_mut(half * gq);
    let (sa, sb) = scales.split_at_mut(half * gs);
    QuantBuffer::quantize_groups(Packing::Q4K, w, 0..half, qa, sa, &mut row);
    QuantBuffer::quantize_groups(Packing::Q4K, w, half..groups, qb, sb, &mut row);
    (source, out)
}

/// 16 rows of Qwen2.5-Coder-0.5B-Instruct's `model.layers.2.mlp.down_proj.weight` (BF16,
/// `[16, 4864]`, from the Hugging Face checkpoint) and the same rows of
/// `blk.2.ffn_down.weight` in the published Q4_K_M GGUF of that model, stored as Q4_K.
///
/// Kylin's quantization is llama.cpp's reference function (`kylin-llamacpp`'s
/// `tests/quantization.rs` checks it byte for byte against llama.cpp's C code). This file was
/// made by another pipeline: its super-block scales `d` and `dmin` were refit by least squares
/// (llama.cpp's importance-matrix path does that; the file's `general.name` says it came from
/// the AWQ checkpoint), so they differ from the reference's `max / 63` in the last bits. Every
/// 6-bit sub-block scale and min and every 4-bit quant is the same.
#[test]
fn quantization_agrees_with_a_published_gguf() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let bf16 = std::fs::read(dir.join("qwen2.5-layer2-down-proj-16-rows.bf16")).expect("fixture");
    let gguf = std::fs::read(dir.join("qwen2.5-layer2-down-proj-16-rows.q4_k")).expect("fixture");
    let (rows, cols) = (16, 4864);
    assert_eq!(bf16.len(), rows * cols * 2);
    let row_bytes = cols / QK_K * GGUF_BLOCK_BYTES;
    assert_eq!(gguf.len(), rows * row_bytes);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &bf16 };
    let (mut row, mut ours) = (vec![0.0f32; cols], vec![0u8; row_bytes]);
    let mut refit = 0;
    for r in 0..rows {
        kylin_kernels::widen_row(w, r, &mut row);
        quantize_row_q4_k_gguf(&row, &mut ours);
        for (b, (a, e)) in
            ours.chunks_exact(144).zip(gguf[r * row_bytes..(r + 1) * row_bytes].chunks_exact(144)).enumerate()
        {
            assert_eq!(a[4..], e[4..], "row {r} super-block {b}: sub-block scales, mins or quants differ");
            for at in [0, 2] {
                let f = |v: &[u8]| half::f16::from_le_bytes([v[at], v[at + 1]]).to_f32();
                let (x, y) = (f(a), f(e));
                assert!((x - y).abs() <= 0.01 * y.abs(), "row {r} super-block {b}: {x} vs {y}, more than 1% apart");
                refit += (x != y) as usize;
            }
        }
    }
    assert!(refit > 0, "the file's scales were expected to be refit");
}

/// llama.cpp's `dequantize_row_q4_K` on one super-block's numbers.
fn dequantize(sb: &SuperBlock, n_sub: usize) -> Vec<f32> {
    let (d, dmin) = (half::f16::from_bits(sb.d).to_f32(), half::f16::from_bits(sb.dmin).to_f32());
    (0..n_sub * 32).map(|i| d * sb.sc[i / 32] as f32 * sb.q[i] as f32 - dmin * sb.m[i / 32] as f32).collect()
}

#[test]
fn the_layout_round_trips_and_partial_super_blocks_are_zero_padded_ones() {
    let mut rng = Rng(7);
    for dtype in [WeightDType::BF16, WeightDType::F16, WeightDType::F32] {
        for (rows, cols) in [(1, 64), (5, 128), (16, 256), (17, 576), (37, 896), (3, 1024)] {
            let (source, data) = packed(&mut rng, dtype, rows, cols);
            let m = data.matrix().as_q4k().expect("q4_k");
            let w = WeightMatrix { dtype, rows, cols, data: &source };
            let (mut row, mut deq) = (vec![0.0f32; cols], vec![0.0f32; cols]);
            for r in 0..rows {
                kylin_kernels::widen_row(w, r, &mut row);
                data.matrix().dequantize_row(r, &mut deq);
                for s in 0..cols.div_ceil(QK_K) {
                    let n_sub = ((cols - s * QK_K) / 32).min(8);
                    let got = super_block_q4_k(m, r, s);
                    // The row's super-block padded with zeros to 256 columns, as llama.cpp
                    // would quantize it.
                    let mut padded = [0.0f32; QK_K];
                    padded[..n_sub * 32].copy_from_slice(&row[s * QK_K..s * QK_K + n_sub * 32]);
                    let full = quantize_super_block(&padded);
                    assert_eq!((got.d, got.dmin), (full.d, full.dmin), "{dtype:?} {rows}x{cols} row {r} sb {s}");
                    assert_eq!(got.sc[..n_sub], full.sc[..n_sub]);
                    assert_eq!(got.m[..n_sub], full.m[..n_sub]);
                    assert_eq!(got.q[..n_sub * 32], full.q[..n_sub * 32]);
                    assert!(full.sc[n_sub..].iter().chain(&full.m[n_sub..]).all(|&v| v == 0));
                    let expected = dequantize(&got, n_sub);
                    let d =
                        half::f16::from_bits(got.d).to_f32() * 63.0 + half::f16::from_bits(got.dmin).to_f32() * 63.0;
                    for (i, e) in expected.iter().enumerate() {
                        assert_eq!(deq[s * QK_K + i].to_bits(), e.to_bits());
                        // A 4-bit step of the sub-block's range: coarse, but never wild.
                        let err = (e - row[s * QK_K + i]).abs();
                        assert!(err <= d / 2.0 + 1e-6, "error {err} vs range {d}");
                    }
                }
            }
        }
    }
    assert_eq!(q4_k_plane_lens(3, 32), None);
    assert_eq!(q4_k_plane_lens(3, 0), None);
    assert_eq!(q4_k_plane_lens(17, 320), Some((2 * 320 * 8, 2 * (2 * 64 + 320))));
    assert!(Q4KMatrix::new(3, 64, &[0; 511], &[0; 128]).is_none());
    assert!(Q4KMatrix::new(3, 64, &[0; 512], &[0; 128]).is_some());
    assert!(QuantBuffer::zeroed(Packing::Q4K, usize::MAX / 2, 64).is_none());
}

/// The activation quantization of the module docs, written independently: per super-block
/// `iscale = 127 / amax`, `q = round_ties_even(x · iscale)`, `dx = 1 / iscale`.
fn activations(x: &[f32]) -> Vec<(Vec<i32>, f32)> {
    let mut out = Vec::new();
    for sb in x.chunks(QK_K) {
        let amax = sb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let iscale = if amax == 0.0 { 0.0 } else { 127.0 / amax };
        let dx = if amax == 0.0 { 0.0 } else { 1.0 / iscale };
        for sub in sb.chunks_exact(32) {
            out.push((sub.iter().map(|v| (v * iscale).round_ties_even() as i32).collect(), dx));
        }
    }
    out
}

/// The canonical order, written independently of the library.
fn canonical(m: Q4KMatrix<'_>, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (m.rows(), m.cols());
    let mut y = vec![0.0f32; n * rows];
    for t in 0..n {
        let xa = activations(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            let mut acc = 0.0f32;
            for (j, (xq, dx)) in xa.iter().enumerate() {
                let sb = super_block_q4_k(m, r, j / 8);
                let sub = j % 8;
                let isum: i32 = (0..32).map(|k| sb.q[sub * 32 + k] as i32 * xq[k]).sum();
                let bx = xq.iter().sum::<i32>() as f32 * dx;
                let dsc = half::f16::from_bits(sb.d).to_f32() * sb.sc[sub] as f32;
                let dm = half::f16::from_bits(sb.dmin).to_f32() * sb.m[sub] as f32;
                acc = (isum as f32).mul_add(dsc * dx, acc);
                acc = (-bx).mul_add(dm, acc);
            }
            y[t * rows + r] = acc;
        }
    }
    y
}

#[test]
fn activation_quantization_matches_its_definition() {
    let mut rng = Rng(11);
    for cols in [64, 320, 896, 1024] {
        let n = 3;
        let mut x = rng.vec(n * cols);
        x[64..128].fill(0.0);
        // amax 127 makes the step exactly 1: x.5 values are ties, rounded to even.
        x[0..8].copy_from_slice(&[127.0, 2.5, -3.5, 0.5, -0.5, 1.5, -126.5, 125.5]);
        if cols >= 320 {
            x[256..320].fill(0.0);
        }
        let mut out = vec![0u8; q4k_scratch_len(n, cols)];
        quantize_activations(&x, n, cols, &mut out);
        let (stride, nb) = (cols + 8 * (cols / 32), cols / 32);
        for t in 0..n {
            let row = &out[t * stride..(t + 1) * stride];
            for (j, (q, dx)) in activations(&x[t * cols..(t + 1) * cols]).iter().enumerate() {
                let got: Vec<i32> = row[j * 32..(j + 1) * 32].iter().map(|&v| v as i8 as i32).collect();
                assert_eq!(&got, q, "cols {cols} token {t} sub-block {j}");
                let f = |at: usize| f32::from_le_bytes(row[at..at + 4].try_into().unwrap());
                assert_eq!(f(cols + 4 * j).to_bits(), dx.to_bits());
                assert_eq!(f(cols + 4 * nb + 4 * j).to_bits(), (q.iter().sum::<i32>() as f32 * dx).to_bits());
            }
        }
    }
}

#[test]
fn products_have_the_canonical_bits_and_the_expected_accuracy() {
    let mut rng = Rng(3);
    // 1344 and 2304 columns: more than one chunk of a prefill's unpacked weights (1024); 150
    // rows: ten groups, split unevenly between the threads.
    for (rows, cols) in
        [(1, 64), (7, 128), (16, 320), (33, 576), (50, 896), (19, 1024), (9, 1344), (20, 2304), (150, 576)]
    {
        let (_, data) = packed(&mut rng, WeightDType::BF16, rows, cols);
        let m = data.matrix().as_q4k().expect("q4_k");
        // 40 tokens: a prefill's path (weights unpacked once for every tile of 8 tokens).
        for n in [1, 2, 5, 8, 9, 19, 40] {
            let x = rng.vec(n * cols);
            let expected = canonical(m, &x, n);
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads);
                let mut scratch = vec![0u8; q4k_scratch_len(n, cols)];
                let mut y = vec![f32::NAN; n * rows];
                matmul_many_q4k(&pool, &x, n, &mut scratch, &mut [(m, &mut y)]);
                let same = y.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{rows}x{cols} n={n} threads={threads}: {y:?} != {expected:?}");
            }
            let mut scalar = vec![f32::NAN; n * rows];
            matmul_q4k_scalar(m, &x, n, &mut scalar);
            assert!(scalar.iter().zip(&expected).all(|(a, b)| a.to_bits() == b.to_bits()), "scalar path");
            // Against the dequantized weights and f32 activations in f64: only the activations'
            // quantization separates them (half a step per element at most), plus rounding.
            let mut deq = vec![0.0f32; cols];
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                for r in 0..rows {
                    data.matrix().dequantize_row(r, &mut deq);
                    let exact: f64 = deq.iter().zip(xt).map(|(w, x)| *w as f64 * *x as f64).sum();
                    let bound: f64 = xt
                        .chunks(QK_K)
                        .zip(deq.chunks(QK_K))
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
    let cols = 384;
    let (_, a) = packed(&mut rng, WeightDType::F16, 40, cols);
    let (_, b) = packed(&mut rng, WeightDType::BF16, 9, cols);
    let (ma, mb) = (a.matrix().as_q4k().expect("q4_k"), b.matrix().as_q4k().expect("q4_k"));
    let pool = ThreadPool::new(2);
    // 45 tokens: a prefill's path, against lone tokens on the decode path.
    for n in [21, 45] {
        let x = rng.vec(n * cols);
        let mut scratch = vec![0u8; q4k_scratch_len(n, cols)];
        let (mut ya, mut yb) = (vec![0.0; n * 40], vec![0.0; n * 9]);
        matmul_many_q4k(&pool, &x, n, &mut scratch, &mut [(ma, &mut ya), (mb, &mut yb)]);
        for t in 0..n {
            let (mut la, mut lb) = (vec![0.0; 40], vec![0.0; 9]);
            matmul_many_q4k(&pool, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut [(ma, &mut la)]);
            matmul_many_q4k(&pool, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut [(mb, &mut lb)]);
            assert!(la.iter().zip(&ya[t * 40..(t + 1) * 40]).all(|(p, q)| p.to_bits() == q.to_bits()), "token {t}");
            assert!(lb.iter().zip(&yb[t * 9..(t + 1) * 9]).all(|(p, q)| p.to_bits() == q.to_bits()), "token {t}");
        }
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
            "quantization_agrees_with_a_published_gguf",
            "activation_quantization_matches_its_definition",
            "products_have_the_canonical_bits_and_the_expected_accuracy",
            "fused_matrices_and_lone_tokens_agree",
            "fast_quantization_is_the_reference",
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

/// A value of `rng` for sub-block kind `kind` (see `fast_quantization_is_the_reference`).
fn awkward(rng: &mut Rng, kind: u64, constant: f32) -> f32 {
    match kind {
        // Magnitudes across the exponents.
        0 => rng.next_f32() * 2f32.powi((rng.next_u64() % 80) as i32 - 40),
        // Zeros of both signs.
        1 => [0.0, -0.0][(rng.next_u64() & 1) as usize],
        2 => constant,
        // All positive: the min is clamped to 0.
        3 => rng.next_f32().abs() + 0.25,
        // Subnormal: `15 / (max − min)` overflows.
        4 => rng.next_f32() * 2f32.powi(-140),
        // Huge: `max − min` and the sums of squares overflow.
        5 => rng.next_f32() * 1e36,
        // Large, with finite sums.
        6 => rng.next_f32() * 1e15,
        // Multiples of 1/8: ties in the roundings.
        7 => ((rng.next_u64() % 33) as f32 - 16.0) / 8.0,
        _ => rng.next_f32(),
    }
}

/// The weight quantization's AVX-512 path (16 rows' sub-blocks at once, one per lane) gives
/// the scalar reference's bits, super-block for super-block: random rows of every kind of
/// sub-block (zero, constant, all positive, subnormal, overflowing, full of ties, magnitudes
/// across the exponents), rows of zeros, rows of zeros with one outlier and constant rows, in
/// groups whose last one is partial.
#[test]
fn fast_quantization_is_the_reference() {
    let mut rng = Rng(13);
    for (rows, cols) in [(21, 64), (16, 256), (35, 320), (19, 896), (17, 4864), (3, 4864)] {
        let mut values = vec![0.0f32; rows * cols];
        for (r, row) in values.chunks_exact_mut(cols).enumerate() {
            match r % 6 {
                0 => row.fill(0.0),
                1 => {
                    let at = (rng.next_u64() % cols as u64) as usize;
                    row[at] = rng.next_f32() * 1e4;
                }
                2 => row.fill(rng.next_f32()),
                3 => row.iter_mut().for_each(|v| *v = rng.next_f32()),
                _ => {
                    for sub in row.chunks_exact_mut(32) {
                        let (kind, constant) = (rng.next_u64() % 9, rng.next_f32());
                        sub.iter_mut().for_each(|v| *v = awkward(&mut rng, kind, constant));
                    }
                }
            }
        }
        let source: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let w = WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &source };
        let mut out = QuantBuffer::zeroed(Packing::Q4K, rows, cols).expect("cols are a multiple of 64");
        let mut row = vec![0.0; cols];
        let (quants, scales) = out.planes_mut();
        QuantBuffer::quantize_groups(Packing::Q4K, w, 0..rows.div_ceil(16), quants, scales, &mut row);
        let m = out.matrix().as_q4k().expect("q4_k");
        for (r, row) in values.chunks_exact(cols).enumerate() {
            for s in 0..cols.div_ceil(QK_K) {
                let n_sub = ((cols - s * QK_K) / 32).min(8);
                let mut padded = [0.0f32; QK_K];
                padded[..n_sub * 32].copy_from_slice(&row[s * QK_K..s * QK_K + n_sub * 32]);
                let expected = quantize_super_block(&padded);
                assert_eq!(super_block_q4_k(m, r, s), expected, "{rows}x{cols} row {r} super-block {s}");
            }
        }
    }
}
