//! MXFP4: packing against the format's definition, and the products against an independent
//! implementation of their canonical order, bit for bit, on every instruction set; each token
//! equal to itself alone; and against f64 within the activations' quantization error.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::ThreadPool;
use kylin_kernels::mxfp4::{VALUES_X2, dequantize_row_mxfp4, mxfp4_plane_lens, pack_mxfp4, scale_half};
use kylin_kernels::quant::{Packing, QuantBuffer, QuantMatrix, matmul_many_quant, quant_scratch_len};
use rng::Rng;

/// FP4 E2M1 by its definition: sign, 2 exponent bits, 1 mantissa bit.
fn fp4(code: u8) -> f64 {
    let sign = if code & 8 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((code >> 1) & 3, code & 1);
    let magnitude = if e == 0 { 0.5 * m as f64 } else { 2f64.powi(e as i32 - 1) * (1.0 + 0.5 * m as f64) };
    sign * magnitude
}

/// A stored checkpoint matrix: `[rows, cols / 32, 16]` codes, `[rows, cols / 32]` scales in
/// a realistic range, with some blocks at the edges (e = 0, 1, 2).
fn stored(rng: &mut Rng, rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    let blocks: Vec<u8> = (0..rows * cols / 2).map(|_| (rng.next_u64() & 0xff) as u8).collect();
    let scales: Vec<u8> = (0..rows * cols / 32)
        .map(|i| match i % 11 {
            0 => 0,
            1 => 1,
            2 => 2,
            _ => 115 + (rng.next_u64() % 12) as u8,
        })
        .collect();
    (blocks, scales)
}

fn packed(rows: usize, cols: usize, blocks: &[u8], scales: &[u8], row_of: &dyn Fn(usize) -> usize) -> QuantBuffer {
    let mut buffer = QuantBuffer::zeroed(Packing::Mxfp4, rows, cols).expect("cols are a multiple of 32");
    let (q, s) = buffer.planes_mut();
    pack_mxfp4(rows, cols, blocks, scales, row_of, q, s).expect("no scale of 255");
    buffer
}

/// The stored weight `(r, c)` by the format's definition (scales below 2^-126 flushed to zero).
fn weight(blocks: &[u8], scales: &[u8], cols: usize, r: usize, c: usize) -> f64 {
    let byte = blocks[r * cols / 2 + c / 2];
    let code = if c.is_multiple_of(2) { byte & 15 } else { byte >> 4 };
    let e = scales[r * cols / 32 + c / 32];
    if e < 2 { 0.0 } else { fp4(code) * 2f64.powi(e as i32 - 127) }
}

#[test]
fn packing_keeps_every_weight_and_refuses_nan_scales() {
    let mut rng = Rng(3);
    for (rows, cols) in [(1, 32), (17, 96), (37, 64)] {
        let (blocks, scales) = stored(&mut rng, rows, cols);
        let buffer = packed(rows, cols, &blocks, &scales, &|r| r);
        let QuantMatrix::Mxfp4(m) = buffer.matrix() else { panic!("an mxfp4 matrix") };
        let mut row = vec![0.0f32; cols];
        for r in 0..rows {
            dequantize_row_mxfp4(m, r, &mut row);
            for (c, &v) in row.iter().enumerate() {
                assert_eq!(v as f64, weight(&blocks, &scales, cols, r, c), "{rows}x{cols} ({r}, {c})");
            }
        }
    }
    // Interleaved rows (gpt-oss's gate and up): packed row i is stored row 2i + 1.
    let (rows, cols) = (9, 64);
    let (blocks, scales) = stored(&mut rng, 2 * rows, cols);
    let buffer = packed(rows, cols, &blocks, &scales, &|r| 2 * r + 1);
    let QuantMatrix::Mxfp4(m) = buffer.matrix() else { panic!("an mxfp4 matrix") };
    let mut row = vec![0.0f32; cols];
    dequantize_row_mxfp4(m, 4, &mut row);
    assert_eq!(row[7] as f64, weight(&blocks, &scales, cols, 9, 7));
    // A scale byte of 255 (NaN in the OCP format) is reported with its place.
    let mut bad = scales.clone();
    bad[2 * 9 + 1] = 255;
    let mut buffer = QuantBuffer::zeroed(Packing::Mxfp4, rows, cols).unwrap();
    let (q, s) = buffer.planes_mut();
    assert_eq!(pack_mxfp4(rows, cols, &blocks, &bad, &|r| 2 * r + 1, q, s), Err((9, 1)));
    assert_eq!(mxfp4_plane_lens(17, 96), Some((2 * 3 * 256, 2 * 3 * 16)));
    assert_eq!(mxfp4_plane_lens(3, 48), None);
    assert_eq!((scale_half(1), scale_half(2), scale_half(128)), (0.0, 2f32.powi(-126), 1.0));
    assert_eq!(VALUES_X2.iter().map(|&v| v as f64 / 2.0).collect::<Vec<_>>(), (0..16).map(fp4).collect::<Vec<_>>());
}

/// Every byte of the planes is written, the padding rows' with zeros: planes that held other
/// bytes before pack to the same bytes as zeroed ones.
#[test]
fn packing_writes_every_byte_of_the_planes() {
    let mut rng = Rng(5);
    let (rows, cols) = (21, 96);
    let (blocks, scales) = stored(&mut rng, rows, cols);
    let zeroed = packed(rows, cols, &blocks, &scales, &|r| r);
    let (quants_len, scales_len) = mxfp4_plane_lens(rows, cols).expect("cols are a multiple of 32");
    let (mut q, mut s) = (vec![0xa5u8; quants_len], vec![0x5au8; scales_len]);
    pack_mxfp4(rows, cols, &blocks, &scales, &|r| r, &mut q, &mut s).expect("no scale of 255");
    let QuantMatrix::Mxfp4(m) = zeroed.matrix() else { panic!("an mxfp4 matrix") };
    assert!(q == m.quants() && s == m.scales(), "the planes differ from the zeroed ones'");
    // The padding rows (`rows..32` of the second group) are zeros in both planes.
    let blocks_per_row = cols / 32;
    for block in 0..blocks_per_row {
        for lane in rows - 16..16 {
            assert_eq!(s[(blocks_per_row + block) * 16 + lane], 0, "scale of padding lane {lane}, block {block}");
            for pair in 0..4 {
                let at = (blocks_per_row + block) * 256 + pair * 64 + lane * 4;
                assert_eq!(&q[at..at + 4], &[0; 4], "codes of padding lane {lane}, block {block}, pair {pair}");
            }
        }
    }
}

/// Q8_0's activation quantization, written independently: per block `d = f16(amax / 127)`,
/// `q = round_ties_even(x · 127 / amax)`.
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

/// The canonical order: exact integer block sums over the doubled values, then
/// `acc = fma(isum, dx · 2^(e − 128), acc)` block by block.
fn canonical(blocks: &[u8], scales: &[u8], rows: usize, cols: usize, x: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; n * rows];
    for t in 0..n {
        let xa = activations(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            let mut acc = 0.0f32;
            for (b, (xq, dx)) in xa.iter().enumerate() {
                let mut isum = 0i32;
                for (k, &xk) in xq.iter().enumerate() {
                    let c = b * 32 + k;
                    let byte = blocks[r * cols / 2 + c / 2];
                    let code = if c.is_multiple_of(2) { byte & 15 } else { byte >> 4 };
                    isum += VALUES_X2[code as usize] as i32 * xk;
                }
                let e = scales[r * cols / 32 + b];
                let s = if e < 2 { 0.0 } else { 2f32.powi(e as i32 - 128) };
                acc = (isum as f32).mul_add(dx * s, acc);
            }
            y[t * rows + r] = acc;
        }
    }
    y
}

#[test]
fn products_have_the_canonical_bits_and_the_expected_accuracy() {
    let mut rng = Rng(9);
    let pool = ThreadPool::new(2);
    for (rows, cols) in [(1, 32), (17, 96), (37, 160), (48, 2880)] {
        let (blocks, scales) = stored(&mut rng, rows, cols);
        let buffer = packed(rows, cols, &blocks, &scales, &|r| r);
        let m = buffer.matrix();
        for n in [1, 2, 5, 9] {
            let x = rng.vec(n * cols);
            let mut scratch = vec![0u8; quant_scratch_len(n, cols)];
            let mut y = vec![0.0f32; n * rows];
            matmul_many_quant(&pool, &x, n, &mut scratch, &mut [(m, &mut y)]);
            let want = canonical(&blocks, &scales, rows, cols, &x, n);
            for (i, (a, b)) in y.iter().zip(&want).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{rows}x{cols}, {n} tokens, output {i}: {a} against {b}");
            }
            // Each token alone gives its row's bits.
            for t in 0..n {
                let mut alone = vec![0.0f32; rows];
                matmul_many_quant(&pool, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut [(m, &mut alone)]);
                assert_eq!(alone, y[t * rows..(t + 1) * rows], "token {t} alone");
            }
            // Against f64 over the exact weights: within the activations' rounding (half a
            // step of each block, `amax / 254`, plus the f16 rounding of the step).
            for t in 0..n {
                let xt = &x[t * cols..(t + 1) * cols];
                let steps: Vec<f64> =
                    xt.chunks_exact(32).map(|b| b.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64 / 127.0).collect();
                for r in 0..rows {
                    let exact: f64 = (0..cols).map(|c| weight(&blocks, &scales, cols, r, c) * xt[c] as f64).sum();
                    let bound: f64 = (0..cols)
                        .map(|c| {
                            weight(&blocks, &scales, cols, r, c).abs()
                                * (0.5 * steps[c / 32] + xt[c].abs() as f64 * 1e-3)
                        })
                        .sum::<f64>()
                        + 1e-30;
                    let err = (y[t * rows + r] as f64 - exact).abs();
                    assert!(err <= bound, "{rows}x{cols} token {t} row {r}: error {err} above {bound}");
                }
            }
        }
    }
}

/// Re-runs the products under every instruction set this machine can be capped to.
#[test]
fn every_isa_gives_the_canonical_bits() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx2", "scalar"] {
        let status = std::process::Command::new(&exe)
            .args(["--exact", "products_have_the_canonical_bits_and_the_expected_accuracy"])
            .env("KYLIN_KERNELS_ISA", cap)
            .status()
            .expect("spawn the test binary");
        assert!(status.success(), "the products fail with KYLIN_KERNELS_ISA={cap}");
    }
}
