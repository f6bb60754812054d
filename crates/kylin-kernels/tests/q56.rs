//! Q5_0 and Q6_0: the quantization (llama.cpp's `quantize_row_q5_0_ref` and ik_llama.cpp's
//! `quantize_row_q6_0_ref`, written again here from their definitions), the exact
//! dequantization, the integer products against an independent implementation of the
//! canonical order (bit for bit, on every instruction set, any token count and thread count),
//! and fused products with the other formats, every token's outputs equal to the token
//! computed alone.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::q56::{
    dequantize_row_q5_0, dequantize_row_q6_0, matmul_many_q5_0, matmul_many_q6_0, matmul_q5_0_scalar,
    matmul_q6_0_scalar, q5_0_plane_lens, q5_0_plane_shapes, q6_0_plane_lens, q6_0_plane_shapes, quantize_block_q5_0,
    quantize_block_q6_0,
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

/// ik_llama.cpp's `quantize_row_q6_0_ref` for one block, from its C source: the f16 scale's
/// bits (refined by weighted least squares) and the 6-bit quants.
fn ik_q6_0(x: &[f32]) -> (u16, Vec<u8>) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -32.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = vec![0u8; 32];
    let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
    for j in 0..16 {
        let x0 = x[j] * id;
        let x1 = x[16 + j] * id;
        let w0 = x0 * x0;
        let w1 = x1 * x1;
        let xi0 = ((x0 + 32.5) as i8).min(63) as u8;
        let xi1 = ((x1 + 32.5) as i8).min(63) as u8;
        q[j] = xi0;
        q[16 + j] = xi1;
        let q0 = xi0 as f32 - 32.0;
        let q1 = xi1 as f32 - 32.0;
        sumqx += w0 * x[j] * q0 + w1 * x[16 + j] * q1;
        sumq2 += w0 * q0 * q0 + w1 * q1 * q1;
    }
    let d = if sumq2 > 0.0 { sumqx / sumq2 } else { d };
    (half::f16::from_f32(d).to_bits(), q)
}

/// What differs between the two formats, for the tests below.
#[derive(Clone, Copy)]
struct Format {
    packing: Packing,
    /// The reference quantizer of one block.
    reference: fn(&[f32]) -> (u16, Vec<u8>),
    /// The quants' offset: `w = d · (q − half)`.
    half: i32,
    /// Bytes of one (group, sub-block) in the scales plane.
    sub_scale_bytes: usize,
}

const Q5_0: Format = Format { packing: Packing::Q5_0, reference: llama_q5_0, half: 16, sub_scale_bytes: 96 };
const Q6_0: Format = Format { packing: Packing::Q6_0, reference: ik_q6_0, half: 32, sub_scale_bytes: 160 };

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
fn quantize(f: Format, w: &[f32], rows: usize, cols: usize) -> QuantBuffer {
    let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &bytes };
    let mut out = QuantBuffer::zeroed(f.packing, rows, cols).expect("cols are a multiple of 64");
    let (gq, gs) = out.group_bytes();
    let groups = rows.div_ceil(16);
    let half = groups / 2;
    let (quants, scales) = out.planes_mut();
    let (qa, qb) = quants.split_at_mut(half * gq);
    let (sa, sb) = scales.split_at_mut(half * gs);
    let mut row = vec![0.0; cols];
    QuantBuffer::quantize_groups(f.packing, m, 0..half, qa, sa, &mut row);
    QuantBuffer::quantize_groups(f.packing, m, half..groups, qb, sb, &mut row);
    out
}

/// Every block's reference numbers, row by row: `(f16 scale widened, quants)`.
fn numbers(f: Format, w: &[f32]) -> Vec<(f32, Vec<u8>)> {
    w.chunks_exact(32)
        .map(|b| {
            let (d, q) = (f.reference)(b);
            (half::f16::from_bits(d).to_f32(), q)
        })
        .collect()
}

/// Row `r` through the format's own dequantizer (not [`QuantMatrix::dequantize_row`]).
fn dequantize_direct(m: QuantMatrix<'_>, r: usize, out: &mut [f32]) {
    match m {
        QuantMatrix::Q5_0(m) => dequantize_row_q5_0(m, r, out),
        QuantMatrix::Q6_0(m) => dequantize_row_q6_0(m, r, out),
        _ => panic!("a q5_0 or q6_0 matrix"),
    }
}

#[test]
fn quantization_is_the_references_and_dequantizes_exactly() {
    let mut rng = Rng(11);
    for f in [Q5_0, Q6_0] {
        check_quantization(f, &mut rng);
    }
}

fn check_quantization(f: Format, rng: &mut Rng) {
    let name = f.packing.name();
    for (rows, cols) in [(1, 64), (5, 128), (16, 64), (17, 896), (37, 1024), (40, 320)] {
        let w = source(rng, rows, cols);
        let data = quantize(f, &w, rows, cols);
        let m = data.matrix();
        assert_eq!((m.rows(), m.cols(), m.packing()), (rows, cols, f.packing));
        let blocks = numbers(f, &w);
        let mut deq = vec![f32::NAN; cols];
        let mut direct = vec![f32::NAN; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut deq);
            dequantize_direct(m, r, &mut direct);
            for c in 0..cols {
                let (d, q) = &blocks[(r * cols + c) / 32];
                let expected = d * (q[c % 32] as i32 - f.half) as f32;
                assert_eq!(deq[c].to_bits(), expected.to_bits(), "{name} {rows}x{cols} row {r} col {c}");
                assert_eq!(direct[c].to_bits(), expected.to_bits());
                let err = (deq[c] - w[r * cols + c]).abs();
                if f.half == 16 {
                    // Within half a step of the weight (plus the scale's f16 rounding), or one
                    // step where Q5_0 clamps: a block whose largest magnitude is positive
                    // reaches only `−15 · |d|` below zero.
                    let steps = if q[c % 32] == 31 { 1.0 } else { 0.5 };
                    assert!(err <= d.abs() * (steps + 16.0 * 1e-3), "{rows}x{cols} ({r}, {c}): error {err}");
                } else {
                    // Q6_0's refined scale moves the grid by at most a few percent: within a
                    // step of the weight, two where it clamps.
                    let steps = if q[c % 32] == 63 { 2.0 } else { 1.0 };
                    assert!(err <= d.abs() * steps, "{name} {rows}x{cols} ({r}, {c}): error {err}");
                }
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
                // `[pair of sub-blocks][scales: 2 · 16 f16][high bits: 2 · (1 (2)) vectors of 64
                // bytes]`. Byte `4 · row + c` of a high-bit vector holds row `row`'s bits.
                let at = i % (2 * f.sub_scale_bytes);
                let padding = if at < 64 { at % 32 / 2 >= valid } else { (at - 64) % 64 / 4 >= valid };
                if padding {
                    assert_eq!(*b, 0, "{name} {rows}x{cols}: padding scale byte {i}");
                }
            }
        }
    }
    // The library's block quantizer is the reference's, scale and quants, on odd blocks too.
    let mut odd = [0.0f32; 32];
    for (i, v) in odd.iter_mut().enumerate() {
        *v = (i as f32 - 15.5) * 0.37;
    }
    let block_quantizer = if f.half == 16 { quantize_block_q5_0 } else { quantize_block_q6_0 };
    for block in [odd, [0.0; 32], [1.0; 32], [-3.0; 32], [f32::MIN_POSITIVE; 32]] {
        let (d, q) = block_quantizer(&block);
        assert_eq!((half::f16::from_f32(d).to_bits(), q.to_vec()), (f.reference)(&block), "{name}");
    }
}

#[test]
fn shapes_and_lengths() {
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
    // 6.5 bits per weight, as ik_llama.cpp's `block_q6_0`.
    assert_eq!(Packing::Q6_0 as u8, 8);
    assert_eq!(Packing::Q6_0.name(), "q6_0");
    assert_eq!(q6_0_plane_lens(3, 32), None);
    assert_eq!(q6_0_plane_lens(17, 320), Some((2 * 5 * 512, 2 * 10 * 160)));
    assert_eq!(q6_0_plane_shapes(17, 320), ([2, 320 * 8], [2, 320 * 5]));
    assert_eq!(Packing::Q6_0.bits_per_weight(32, 1024), Some(6.5));
    assert!(QuantMatrix::new(Packing::Q6_0, 3, 64, &[0; 512], &[0; 320]).is_some());
    assert!(QuantMatrix::new(Packing::Q6_0, 3, 64, &[0; 512], &[0; 192]).is_none());
    // The three U8-scaled formats' scales planes never have the same length for the same
    // shape (how a loader tells stored planes apart), and a stored plane's length picks its
    // format back.
    for cols in (64..=8192).step_by(64) {
        let scales = |p: Packing| p.plane_lens(16, cols).map(|(_, s)| s);
        assert_ne!(scales(Packing::Q4K), scales(Packing::Q5_0), "{cols}");
        assert_ne!(scales(Packing::Q4K), scales(Packing::Q6_0), "{cols}");
        assert_ne!(scales(Packing::Q5_0), scales(Packing::Q6_0), "{cols}");
        // (Q4_K is stored for whole 256-column super-blocks and Q5_0 for the others, the
        // recipe's rule.)
        let four_bit = if cols % 256 == 0 { Packing::Q4K } else { Packing::Q5_0 };
        for p in [four_bit, Packing::Q6_0] {
            if let Some(s) = scales(p) {
                assert_eq!(Packing::with_byte_scales(16, cols, s), p, "{cols}: {}", p.name());
            }
        }
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
fn canonical(f: Format, blocks: &[(f32, Vec<u8>)], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let nb = cols / 32;
    let mut y = vec![0.0f32; n * rows];
    for t in 0..n {
        let xa = activations(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            let mut acc = 0.0f32;
            for (j, (xq, dx)) in xa.iter().enumerate() {
                let (d, q) = &blocks[r * nb + j];
                let isum: i32 = (0..32).map(|k| (q[k] as i32 - f.half) * xq[k]).sum();
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
    for (f, (rows, cols)) in [Q5_0, Q6_0].into_iter().flat_map(|f| {
        [(1, 64), (7, 128), (16, 320), (33, 576), (50, 896), (19, 1024), (200, 1024), (9, 1344), (20, 2304)]
            .map(|shape| (f, shape))
    }) {
        let w = source(&mut rng, rows, cols);
        let blocks = numbers(f, &w);
        let data = quantize(f, &w, rows, cols);
        let m = data.matrix();
        let name = f.packing.name();
        // 33 and 70 tokens: a prefill's path (weights unpacked once for every tile of 8
        // tokens); 1344 and 2304 columns: more than one chunk of them (1024).
        for n in (1..=20).chain([33, 70]) {
            if rows * cols > 64 * 1024 && n % 3 != 1 && n != 20 && n != 70 {
                // The large matrix at a sample of token counts only (1, 4, 7, ..., 19, 20).
                continue;
            }
            let x = rng.vec(n * cols);
            let expected = canonical(f, &blocks, rows, cols, &x, n);
            for pool in &pools {
                let mut scratch = vec![0u8; q8_scratch_len(n, cols)];
                let mut y = vec![f32::NAN; n * rows];
                // (n, cols) · (rows, cols)ᵀ -> (n, rows)
                match m {
                    QuantMatrix::Q5_0(m) => matmul_many_q5_0(pool, &x, n, &mut scratch, &mut [(m, &mut y)]),
                    QuantMatrix::Q6_0(m) => matmul_many_q6_0(pool, &x, n, &mut scratch, &mut [(m, &mut y)]),
                    _ => panic!("a q5_0 or q6_0 matrix"),
                }
                assert!(same_bits(&y, &expected), "{name} {rows}x{cols} n={n} threads={}", pool.threads());
            }
            let mut scalar = vec![f32::NAN; n * rows];
            // (n, cols) · (rows, cols)ᵀ -> (n, rows) on the scalar tile.
            match m {
                QuantMatrix::Q5_0(m) => matmul_q5_0_scalar(m, &x, n, &mut scalar),
                QuantMatrix::Q6_0(m) => matmul_q6_0_scalar(m, &x, n, &mut scalar),
                _ => panic!("a q5_0 or q6_0 matrix"),
            }
            assert!(same_bits(&scalar, &expected), "{name} {rows}x{cols} n={n}: scalar path");
        }
    }
}

/// One fused call over Q8_0, Q4_K, Q5_0 and Q6_0 matrices sharing an input (Q5_0 and Q6_0
/// reading Q8_0's activations, Q4_K its own) gives every matrix the bits it gets alone, and every token the
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
        quantized(&mut rng, Packing::Q6_0, 33),
        quantized(&mut rng, Packing::Q6_0, 16),
    ];
    let matrices: Vec<QuantMatrix<'_>> = buffers.iter().map(|b| b.matrix()).collect();
    let pool = ThreadPool::new(2);
    // 45 tokens: a prefill's path, against lone tokens on the decode path.
    for n in [21, 45] {
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
            "quantization_is_the_references_and_dequantizes_exactly",
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
