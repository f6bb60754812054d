//! Q5_0: the quantization (llama.cpp's `quantize_row_q5_0_ref`, written again here from its
//! definition), the exact dequantization, the integer products against an independent
//! implementation of the canonical order (bit for bit, on every instruction set, any token
//! count and thread count), and fused products with the other formats sharing Q4_K's
//! activations, every token's outputs equal to the token computed alone.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::q5::{
    dequantize_row_q5_0, matmul_many_q5_0, matmul_q5_0_scalar, q5_0_plane_lens, q5_0_plane_shapes, quantize_block_q5_0,
};
use kylin_kernels::quant::{Packing, QuantBuffer, QuantMatrix, matmul_many_quant, q8_scratch_len, quant_scratch_len};
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix};
use rng::Rng;

/// llama.cpp's `quantize_row_q5_0_ref` for one block, from its C source: the f16 scale's
/// bits and the 5-bit quants.
fn llama_q5_0(x: &[f32]) -> (u16, Vec<u8>) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -16.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let q = x.iter().map(|&v| ((v * id + 16.5) as i8).min(31) as u8).collect();
    (half::f16::from_f32(d).to_bits(), q)
}

/// Weights for a `[rows, cols]` matrix: random values, with blocks of zeros, blocks whose
/// largest value is negative and blocks whose largest magnitude ties between signs.
fn source(rng: &mut Rng, rows: usize, cols: usize) -> Vec<f32> {
    let mut w = rng.vec(rows * cols);
    for (b, block) in w.chunks_exact_mut(32).enumerate() {
        match b % 9 {
            0 => block.fill(0.0),
            1 => block[(b * 7) % 32] = -4.0,
            2 => {
                block[3] = 2.5;
                block[20] = -2.5;
            }
            _ => {}
        }
    }
    w
}

/// The matrix quantized from f32 weights, in two calls over split group ranges (as the
/// engine quantizes in parallel).
fn quantize(w: &[f32], rows: usize, cols: usize) -> QuantBuffer {
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &bytes };
    let mut out = QuantBuffer::zeroed(Packing::Q5_0, rows, cols).expect("cols are a multiple of 64");
    let (gq, gs) = out.group_bytes();
    let groups = rows.div_ceil(16);
    let half = groups / 2;
    let (quants, scales) = out.planes_mut();
    let (qa, qb) = quants.split_at_mut(half * gq);
    let (sa, sb) = scales.split_at_mut(half * gs);
    let mut row = vec![0.0; cols];
    QuantBuffer::quantize_groups(Packing::Q5_0, m, 0..half, qa, sa, &mut row);
    QuantBuffer::quantize_groups(Packing::Q5_0, m, half..groups, qb, sb, &mut row);
    out
}

/// Every block's llama.cpp numbers, row by row: `(f16 scale widened, quants)`.
fn numbers(w: &[f32]) -> Vec<(f32, Vec<u8>)> {
    w.chunks_exact(32)
        .map(|b| {
            let (d, q) = llama_q5_0(b);
            (half::f16::from_bits(d).to_f32(), q)
        })
        .collect()
}

#[test]
fn quantization_is_llama_cpps_and_dequantizes_exactly() {
    let mut rng = Rng(11);
    for (rows, cols) in [(1, 64), (5, 128), (16, 64), (17, 896), (37, 1024), (40, 320)] {
        let w = source(&mut rng, rows, cols);
        let data = quantize(&w, rows, cols);
        let m = data.matrix();
        assert_eq!((m.rows(), m.cols(), m.packing()), (rows, cols, Packing::Q5_0));
        let blocks = numbers(&w);
        let mut deq = vec![f32::NAN; cols];
        let mut direct = vec![f32::NAN; cols];
        let QuantMatrix::Q5_0(q5) = m else { panic!("a q5_0 matrix") };
        for r in 0..rows {
            m.dequantize_row(r, &mut deq);
            dequantize_row_q5_0(q5, r, &mut direct);
            for c in 0..cols {
                let (d, q) = &blocks[(r * cols + c) / 32];
                let expected = d * (q[c % 32] as f32 - 16.0);
                assert_eq!(deq[c].to_bits(), expected.to_bits(), "{rows}x{cols} row {r} col {c}");
                assert_eq!(direct[c].to_bits(), expected.to_bits());
                // Within half a step of the weight (plus the scale's f16 rounding), or one step
                // where Q5_0 clamps: a block whose largest magnitude is positive reaches only
                // `−15 · |d|` below zero.
                let err = (deq[c] - w[r * cols + c]).abs();
                let steps = if q[c % 32] == 31 { 1.0 } else { 0.5 };
                assert!(err <= d.abs() * (steps + 16.0 * 1e-3), "{rows}x{cols} ({r}, {c}): error {err}");
            }
        }
        // The padding rows of the last group are zero in both planes.
        let (gq, gs) = data.group_bytes();
        let (valid, groups) = (rows % 16, rows.div_ceil(16));
        if valid != 0 {
            let (last_q, last_s) = (&m.quants()[(groups - 1) * gq..], &m.scales()[(groups - 1) * gs..]);
            for (i, b) in last_q.iter().enumerate() {
                if (i % 64) / 4 >= valid {
                    assert_eq!(*b, 0, "{rows}x{cols}: padding quant byte {i}");
                }
            }
            for (i, b) in last_s.iter().enumerate() {
                // `[sub-block][scale: 16 f16][high bits: 8 u64, bit 4 · row + c]`.
                // A high-bit byte holds rows `2b` and `2b + 1` (`b` its place in its word).
                let at = i % 96;
                let padding = if at < 32 { at / 2 >= valid } else { 2 * ((at - 32) % 8) >= valid };
                if padding {
                    assert_eq!(*b, 0, "{rows}x{cols}: padding scale byte {i}");
                }
            }
        }
    }
    // The library's block quantizer is llama.cpp's, scale and quants, on odd blocks too.
    let mut odd = [0.0f32; 32];
    for (i, v) in odd.iter_mut().enumerate() {
        *v = (i as f32 - 15.5) * 0.37;
    }
    for block in [odd, [0.0; 32], [1.0; 32], [-3.0; 32], [f32::MIN_POSITIVE; 32]] {
        let (d, q) = quantize_block_q5_0(&block);
        assert_eq!((half::f16::from_f32(d).to_bits(), q.to_vec()), llama_q5_0(&block));
    }
    // Shapes and views: 5.5 bits per weight, as GGUF's `block_q5_0`.
    assert_eq!(Packing::Q5_0 as u8, 7);
    assert_eq!(Packing::Q5_0.name(), "q5_0");
    assert_eq!(q5_0_plane_lens(3, 32), None);
    assert_eq!(q5_0_plane_lens(3, 0), None);
    assert_eq!(q5_0_plane_lens(usize::MAX, 1 << 20), None);
    assert_eq!(q5_0_plane_lens(17, 320), Some((2 * 5 * 512, 2 * 10 * 96)));
    assert_eq!(q5_0_plane_shapes(17, 320), ([2, 320 * 8], [2, 320 * 3]));
    assert_eq!(Packing::Q5_0.bits_per_weight(32, 1024), Some(5.5));
    assert!(QuantMatrix::new(Packing::Q5_0, 3, 64, &[0; 512], &[0; 191]).is_none());
    assert!(QuantMatrix::new(Packing::Q5_0, 3, 64, &[0; 512], &[0; 192]).is_some());
    // Q4_K's scales plane never has Q5_0's length for the same shape (how a loader tells
    // stored planes apart).
    for cols in (64..=8192).step_by(64) {
        assert_ne!(Packing::Q4K.plane_lens(16, cols), Packing::Q5_0.plane_lens(16, cols), "{cols}");
    }
}

/// The activation quantization of Q8_0 (which Q5_0 reads, as llama.cpp's Q5_0 products do),
/// written independently: per block of 32, `dx = f16(amax / 127)`, `q = round_ties_even(x ·
/// 127 / amax)` (0 when `dx` is 0).
fn activations(x: &[f32]) -> Vec<(Vec<i32>, f32)> {
    x.chunks_exact(32)
        .map(|block| {
            let amax = block.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let dx = half::f16::from_f32(amax / 127.0).to_f32();
            let id = if dx != 0.0 { 127.0 / amax } else { 0.0 };
            (block.iter().map(|v| ((v * id).round_ties_even() as i32).clamp(-128, 127)).collect(), dx)
        })
        .collect()
}

/// The canonical order, written independently of the library (from llama.cpp's numbers, not
/// the packed planes): `(n, cols) · (rows, cols)ᵀ -> (n, rows)`.
fn canonical(blocks: &[(f32, Vec<u8>)], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let nb = cols / 32;
    let mut y = vec![0.0f32; n * rows];
    for t in 0..n {
        let xa = activations(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            let mut acc = 0.0f32;
            for (j, (xq, dx)) in xa.iter().enumerate() {
                let (d, q) = &blocks[r * nb + j];
                let isum: i32 = (0..32).map(|k| (q[k] as i32 - 16) * xq[k]).sum();
                acc = (isum as f32).mul_add(d * dx, acc);
            }
            y[t * rows + r] = acc;
        }
    }
    y
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

#[test]
fn products_have_the_canonical_bits() {
    let mut rng = Rng(13);
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    // (200, 1024) is large enough for the products to split across the pool's threads.
    for (rows, cols) in [(1, 64), (7, 128), (16, 320), (33, 576), (50, 896), (19, 1024), (200, 1024)] {
        let w = source(&mut rng, rows, cols);
        let blocks = numbers(&w);
        let data = quantize(&w, rows, cols);
        let QuantMatrix::Q5_0(m) = data.matrix() else { panic!("a q5_0 matrix") };
        for n in 1..=20 {
            if rows * cols > 64 * 1024 && n % 3 != 1 && n != 20 {
                // The large matrix at a sample of token counts only (1, 4, 7, ..., 19, 20).
                continue;
            }
            let x = rng.vec(n * cols);
            let expected = canonical(&blocks, rows, cols, &x, n);
            for pool in &pools {
                let mut scratch = vec![0u8; q8_scratch_len(n, cols)];
                let mut y = vec![f32::NAN; n * rows];
                // (n, cols) · (rows, cols)ᵀ -> (n, rows)
                matmul_many_q5_0(pool, &x, n, &mut scratch, &mut [(m, &mut y)]);
                assert!(same_bits(&y, &expected), "{rows}x{cols} n={n} threads={}", pool.threads());
            }
            let mut scalar = vec![f32::NAN; n * rows];
            // (n, cols) · (rows, cols)ᵀ -> (n, rows) on the scalar tile.
            matmul_q5_0_scalar(m, &x, n, &mut scalar);
            assert!(same_bits(&scalar, &expected), "{rows}x{cols} n={n}: scalar path");
        }
    }
}

/// One fused call over Q8_0, Q4_K and Q5_0 matrices sharing an input (Q5_0 reading Q8_0's
/// activations, Q4_K its own) gives every matrix the bits it gets alone, and every token the
/// bits it gets alone (batch invariance).
#[test]
fn fused_formats_and_lone_tokens_agree() {
    let mut rng = Rng(5);
    // 384 columns: a partial super-block for Q4_K's activations.
    let cols = 384;
    let quantized = |rng: &mut Rng, packing: Packing, rows: usize| {
        let source = rng.weights(WeightDType::BF16, rows * cols);
        let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &source };
        let mut out = QuantBuffer::zeroed(packing, rows, cols).expect("a valid shape");
        let (quants, scales) = out.planes_mut();
        QuantBuffer::quantize_groups(packing, w, 0..rows.div_ceil(16), quants, scales, &mut vec![0.0; cols]);
        out
    };
    let buffers = [
        quantized(&mut rng, Packing::Q8_0, 24),
        quantized(&mut rng, Packing::Q5_0, 40),
        quantized(&mut rng, Packing::Q4K, 9),
        quantized(&mut rng, Packing::Q5_0, 70),
    ];
    let matrices: Vec<QuantMatrix<'_>> = buffers.iter().map(|b| b.matrix()).collect();
    let pool = ThreadPool::new(2);
    let n = 21;
    let x = rng.vec(n * cols);
    let mut scratch = vec![0u8; quant_scratch_len(n, cols)];
    let mut ys: Vec<Vec<f32>> = matrices.iter().map(|m| vec![f32::NAN; n * m.rows()]).collect();
    {
        // (n, cols) · (rows_i, cols)ᵀ -> (n, rows_i) for every matrix, in one call.
        let mut jobs: Vec<(QuantMatrix<'_>, &mut [f32])> =
            matrices.iter().copied().zip(ys.iter_mut().map(|y| &mut y[..])).collect();
        matmul_many_quant(&pool, &x, n, &mut scratch, &mut jobs);
    }
    for (i, (m, y)) in matrices.iter().zip(&ys).enumerate() {
        let rows = m.rows();
        // (n, cols) · (rows, cols)ᵀ -> (n, rows), this matrix alone.
        let mut alone = vec![f32::NAN; n * rows];
        m.matmul(&pool, &x, n, &mut scratch, &mut alone);
        assert!(same_bits(&alone, y), "matrix {i} ({}): fused vs alone", m.packing().name());
        for t in 0..n {
            // (1, cols) · (rows, cols)ᵀ -> (1, rows), token `t` alone.
            let mut lone = vec![f32::NAN; rows];
            m.matmul(&pool, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut lone);
            assert!(same_bits(&lone, &y[t * rows..(t + 1) * rows]), "matrix {i} token {t}: batch vs alone");
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
            "quantization_is_llama_cpps_and_dequantizes_exactly",
            "products_have_the_canonical_bits",
            "fused_formats_and_lone_tokens_agree",
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
