//! Weight-only products with BF16 activations (`q8_0_a16`, `q4_g_a16`, `f8_e4m3_a16`): FP8
//! E4M3 decoding against its definition for every code, the packed FP8 layout's round trip, the
//! products against f64 over the exact weights and the BF16-rounded activations (the only
//! rounding left is f32 accumulation), and batch invariance: every token's outputs have the
//! same bits computed alone, in a batch, fused with the int8 formats, on one thread or two.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::q4g::pack_q4_g;
use kylin_kernels::quant::{Packing, QuantBuffer, QuantMatrix, matmul_many_quant, pack_q8_0, quant_scratch_len};
use kylin_kernels::w16::{F8Matrix, dequantize_row_f8, e4m3_to_f32, f8_plane_lens, pack_f8};
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix, round_bf16};
use rng::Rng;

/// E4M3 by its definition: `(−1)^s · 2^(e − 7) · (1 + m/8)`, subnormals `2^−6 · m/8`.
fn e4m3_definition(b: u8) -> f64 {
    let (s, e, m) = (b >> 7, ((b >> 3) & 15) as i32, (b & 7) as f64);
    let v = if e == 0 { 2f64.powi(-6) * m / 8.0 } else { 2f64.powi(e - 7) * (1.0 + m / 8.0) };
    if s == 1 { -v } else { v }
}

#[test]
fn e4m3_decodes_every_code_exactly() {
    for b in 0..=255u8 {
        let got = e4m3_to_f32(b);
        if b & 0x7F == 0x7F {
            assert!(got.is_nan(), "code {b:#04x} is NaN");
        } else {
            assert_eq!(got as f64, e4m3_definition(b), "code {b:#04x}");
        }
    }
}

/// A matrix's exact weights (row-major), the f32 values its rows dequantize to (the same,
/// except FP8's `e4m3 · scale`, one f32 product), and its packed buffer.
struct Case {
    rows: usize,
    cols: usize,
    weights: Vec<f64>,
    dequantized: Vec<f32>,
    buffer: QuantBuffer,
}

/// Random codes of `packing` with scales that are exact in their stored type. FP8 codes cover
/// every non-NaN value, subnormals and both zeros included.
fn case(rng: &mut Rng, packing: Packing, rows: usize, cols: usize) -> Case {
    let nb = cols / 32;
    let mut buffer = QuantBuffer::zeroed(packing, rows, cols).expect("a valid shape");
    let mut weights = vec![0.0f64; rows * cols];
    let mut dequantized = Vec::new();
    let scale = |rng: &mut Rng| half::f16::from_f32(rng.next_f32().abs() / 64.0).to_f32();
    match packing {
        Packing::Q8_0A16 => {
            let q: Vec<i8> = (0..rows * cols).map(|_| rng.next_u64() as i8).collect();
            let s: Vec<f32> = (0..rows * nb).map(|_| scale(rng)).collect();
            for (i, w) in weights.iter_mut().enumerate() {
                *w = q[i] as f64 * s[(i / cols) * nb + (i % cols) / 32] as f64;
            }
            let (quants, scales) = buffer.planes_mut();
            pack_q8_0(rows, cols, &q, &s, quants, scales);
        }
        Packing::Q4GA16 => {
            let q: Vec<u8> = (0..rows * cols).map(|_| (rng.next_u64() % 16) as u8).collect();
            let s: Vec<f32> = (0..rows * nb).map(|_| scale(rng)).collect();
            let m: Vec<f32> = (0..rows * nb).map(|k| s[k] * (rng.next_u64() % 16) as f32).collect();
            for (i, w) in weights.iter_mut().enumerate() {
                let k = (i / cols) * nb + (i % cols) / 32;
                *w = s[k] as f64 * q[i] as f64 - half::f16::from_f32(m[k]).to_f32() as f64;
            }
            let (quants, scales) = buffer.planes_mut();
            pack_q4_g(rows, cols, &q, &s, &m, quants, scales);
        }
        Packing::F8A16 => {
            let codes: Vec<u8> = (0..rows * cols)
                .map(|i| {
                    // Every code in the first 256; then, by group of 16 rows in turn, random
                    // codes, codes with a non-zero exponent only, and codes whose zero
                    // exponents are zeros only (the kernels' fast decodes run on chunks of the
                    // last two kinds).
                    let nonzero_exponent = |b: u8| if b & 0x78 == 0 { b | 0x08 } else { b };
                    let no_subnormal = |b: u8| if b & 0x78 == 0 { b & 0x80 } else { b };
                    let b = match i {
                        0..256 => i as u8,
                        _ if (i / cols / 16) % 3 == 1 => nonzero_exponent(rng.next_u64() as u8),
                        _ if (i / cols / 16) % 3 == 2 => no_subnormal(rng.next_u64() as u8),
                        _ => rng.next_u64() as u8,
                    };
                    if b & 0x7F == 0x7F { 0 } else { b }
                })
                .collect();
            // One scale in five negative, as a checkpoint may have them: `pack_f8` marks the
            // rows of a block holding a subnormal code with a negative scale, negating the
            // positive ones, so a negative scale of the checkpoint's own is a mark already
            // (and a spurious one where its block holds no subnormal).
            let s: Vec<f32> =
                (0..rows * nb).map(|k| rng.next_f32().abs() / 256.0 * if k % 5 == 3 { -1.0 } else { 1.0 }).collect();
            for (i, w) in weights.iter_mut().enumerate() {
                *w = e4m3_definition(codes[i]) * s[(i / cols) * nb + (i % cols) / 32] as f64;
            }
            dequantized = (0..rows * cols)
                .map(|i| e4m3_definition(codes[i]) as f32 * s[(i / cols) * nb + (i % cols) / 32])
                .collect();
            let (quants, scales) = buffer.planes_mut();
            pack_f8(rows, cols, &codes, &s, quants, scales);
        }
        other => panic!("not an _a16 packing: {other:?}"),
    }
    if dequantized.is_empty() {
        dequantized = weights.iter().map(|&w| w as f32).collect();
        assert!(dequantized.iter().zip(&weights).all(|(&a, &b)| a as f64 == b), "integer weights are exact in f32");
    }
    Case { rows, cols, weights, dequantized, buffer }
}

const PACKINGS: [Packing; 3] = [Packing::Q8_0A16, Packing::Q4GA16, Packing::F8A16];

/// `pack_f8` writes every byte of the planes, the padding rows' with zeros: planes that held
/// other bytes before pack to the bytes of zeroed ones, and the padding lanes are zero.
#[test]
fn f8_packing_writes_every_byte_of_the_planes() {
    let (rows, cols) = (21, 96);
    let nb = cols / 32;
    let codes: Vec<u8> = (0..rows * cols).map(|i| (i * 37 % 251) as u8 | 0x08).collect();
    let s: Vec<f32> = (0..rows * nb).map(|i| 1.0 + i as f32).collect();
    let (quants_len, scales_len) = f8_plane_lens(rows, cols).expect("a valid shape");
    let (mut zq, mut zs) = (vec![0u8; quants_len], vec![0u8; scales_len]);
    pack_f8(rows, cols, &codes, &s, &mut zq, &mut zs);
    let (mut q, mut sc) = (vec![0xa5u8; quants_len], vec![0x5au8; scales_len]);
    pack_f8(rows, cols, &codes, &s, &mut q, &mut sc);
    assert!(q == zq && sc == zs, "the planes differ from the zeroed ones'");
    // The padding rows (`rows..32` of the second group) are zeros in both planes.
    for block in 0..nb {
        for lane in rows - 16..16 {
            let at = (nb + block) * 64 + 4 * lane;
            assert_eq!(&sc[at..at + 4], &[0; 4], "scale of padding lane {lane}, block {block}");
            for k4 in 0..8 {
                let at = (nb + block) * 512 + k4 * 64 + lane * 4;
                assert_eq!(&q[at..at + 4], &[0; 4], "codes of padding lane {lane}, block {block}, k4 {k4}");
            }
        }
    }
    // And the rows' bytes are where the layout puts them: row 17 (lane 1 of the second group),
    // codes 4..8 of block 2.
    let lane = 17 % 16;
    let at = (nb + 2) * 512 + 64 + lane * 4;
    assert_eq!(&q[at..at + 4], &codes[17 * cols + 64 + 4..17 * cols + 64 + 8]);
}

/// `pack_f8` stores each row of a block that holds a subnormal code under a negative scale,
/// negating a positive one and flipping the codes' signs, so that each weight keeps its value.
/// Row 0 has one subnormal in block 1; row 1 none (zeros of both signs only), under a negative
/// scale in block 1; row 2 one in block 0, under a scale that is negative in the checkpoint.
#[test]
fn f8_packing_marks_the_rows_of_a_block_holding_a_subnormal() {
    let (rows, cols) = (3, 64);
    let mut codes: Vec<u8> =
        (0..rows * cols).map(|i| (0x38 + (i % 7) as u8) | if i % 3 == 0 { 0x80 } else { 0 }).collect();
    codes[32 + 5] = 0x83; // row 0, block 1: −3 · 2^−9
    codes[cols + 3] = 0x00;
    codes[cols + 40] = 0x80;
    codes[2 * cols + 31] = 0x01; // row 2, block 0: 2^−9
    let s = [0.5, 0.25, 2.0, -4.0, -1.5, 3.0];
    let (quants_len, scales_len) = f8_plane_lens(rows, cols).expect("a valid shape");
    let (mut q, mut sc) = (vec![0u8; quants_len], vec![0u8; scales_len]);
    pack_f8(rows, cols, &codes, &s, &mut q, &mut sc);
    let flipped = [[false, true], [false, false], [false, false]];
    for (r, flipped) in flipped.iter().enumerate() {
        for (b, &flipped) in flipped.iter().enumerate() {
            let at = b * 64 + 4 * r;
            let scale = f32::from_le_bytes(sc[at..at + 4].try_into().unwrap());
            let expected = if flipped { -s[r * 2 + b] } else { s[r * 2 + b] };
            assert_eq!(scale.to_bits(), expected.to_bits(), "scale of row {r}, block {b}");
            for k in 0..32 {
                let packed = q[b * 512 + (k / 4) * 64 + r * 4 + k % 4];
                let code = codes[r * cols + b * 32 + k];
                assert_eq!(packed, if flipped { code ^ 0x80 } else { code }, "code {k} of row {r}, block {b}");
            }
        }
    }
    let m = F8Matrix::new(rows, cols, &q, &sc).expect("planes of the right lengths");
    let mut row = vec![0.0f32; cols];
    for r in 0..rows {
        dequantize_row_f8(m, r, &mut row);
        for (c, &w) in row.iter().enumerate() {
            let expected = e4m3_definition(codes[r * cols + c]) as f32 * s[r * 2 + c / 32];
            assert_eq!(w, expected, "weight ({r}, {c})");
        }
    }
}

#[test]
fn packed_weights_dequantize_to_the_exact_values() {
    let mut rng = Rng(3);
    for packing in PACKINGS {
        for (rows, cols) in [(1, 64), (17, 128), (40, 320)] {
            let c = case(&mut rng, packing, rows, cols);
            let m = c.buffer.matrix();
            assert_eq!(m.packing(), packing);
            let mut row = vec![0.0f32; cols];
            for r in 0..rows {
                m.dequantize_row(r, &mut row);
                for (k, &v) in row.iter().enumerate() {
                    assert_eq!(v, c.dequantized[r * cols + k], "{} ({rows}, {cols}) at ({r}, {k})", packing.name());
                }
            }
        }
    }
    let (q, s) = f8_plane_lens(17, 96).expect("a valid shape");
    assert_eq!((q, s), (2 * 3 * 512, 2 * 3 * 64), "FP8 planes: Q8_0's quants, f32 scales");
    assert!(F8Matrix::new(17, 96, &vec![0; q], &vec![0; s - 1]).is_none(), "a short scales plane is refused");
    let mut row = vec![0.0; 96];
    let (quants, scales) = (vec![0x38u8; q], [2.0f32.to_le_bytes(); 2 * 3 * 16].concat());
    dequantize_row_f8(F8Matrix::new(17, 96, &quants, &scales).expect("planes"), 16, &mut row);
    assert!(row.iter().all(|&v| v == 2.0), "code 0x38 is 1.0, times the scale 2");
}

/// `y = bf16(x) · Wᵀ` in f64 from the exact weights.
fn reference(c: &Case, x: &[f32], n: usize) -> Vec<f64> {
    let xb: Vec<f64> = x.iter().map(|&v| f32::from_bits((round_bf16(v) as u32) << 16) as f64).collect();
    let mut y = vec![0.0; n * c.rows];
    for t in 0..n {
        for r in 0..c.rows {
            y[t * c.rows + r] = (0..c.cols).map(|k| c.weights[r * c.cols + k] * xb[t * c.cols + k]).sum();
        }
    }
    y
}

/// Σ |w · x| per output: the scale of f32 accumulation's rounding.
fn magnitude(c: &Case, x: &[f32], t: usize, r: usize) -> f64 {
    (0..c.cols).map(|k| (c.weights[r * c.cols + k] * x[t * c.cols + k] as f64).abs()).sum()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn products_match_f64_over_the_exact_weights() {
    let mut rng = Rng(11);
    let pool = ThreadPool::new(2);
    for packing in PACKINGS {
        for (rows, cols, n) in [(16, 64, 1), (17, 128, 5), (40, 320, 9), (3, 1024, 4)] {
            let c = case(&mut rng, packing, rows, cols);
            let x = rng.vec(n * cols);
            let mut scratch = vec![0u8; quant_scratch_len(n, cols)];
            let mut y = vec![f32::NAN; n * rows];
            // (n, cols) · (rows, cols)ᵀ -> (n, rows)
            c.buffer.matrix().matmul(&pool, &x, n, &mut scratch, &mut y);
            let want = reference(&c, &x, n);
            for t in 0..n {
                for r in 0..rows {
                    let (got, want) = (y[t * rows + r] as f64, want[t * rows + r]);
                    let bound = 1e-5 * magnitude(&c, &x, t, r) + 1e-30;
                    assert!(
                        (got - want).abs() <= bound,
                        "{} ({rows}, {cols}) token {t} row {r}: {got} vs {want} (bound {bound})",
                        packing.name()
                    );
                }
            }
        }
    }
}

/// A Q8_0 matrix quantized from random BF16 weights (int8 activations), to fuse with.
fn int8_matrix(rng: &mut Rng, rows: usize, cols: usize) -> QuantBuffer {
    let source = rng.weights(WeightDType::BF16, rows * cols);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &source };
    let mut out = QuantBuffer::zeroed(Packing::Q8_0, rows, cols).expect("a valid shape");
    let (quants, scales) = out.planes_mut();
    QuantBuffer::quantize_groups(Packing::Q8_0, w, 0..rows.div_ceil(16), quants, scales, &mut vec![0.0; cols]);
    out
}

#[test]
fn every_token_has_the_same_bits_alone_in_a_batch_fused_and_on_any_thread_count() {
    let mut rng = Rng(23);
    let cols = 384;
    let buffers = [
        case(&mut rng, Packing::Q4GA16, 40, cols).buffer,
        int8_matrix(&mut rng, 24, cols),
        case(&mut rng, Packing::F8A16, 33, cols).buffer,
        case(&mut rng, Packing::Q8_0A16, 16, cols).buffer,
    ];
    let matrices: Vec<QuantMatrix<'_>> = buffers.iter().map(|b| b.matrix()).collect();
    let (one, two) = (ThreadPool::new(1), ThreadPool::new(2));
    let n = 23;
    let x = rng.vec(n * cols);
    let mut scratch = vec![0u8; quant_scratch_len(n, cols)];
    let mut ys: Vec<Vec<f32>> = matrices.iter().map(|m| vec![f32::NAN; n * m.rows()]).collect();
    {
        // (n, cols) · (rows_i, cols)ᵀ -> (n, rows_i) for every matrix, in one call.
        let mut jobs: Vec<(QuantMatrix<'_>, &mut [f32])> =
            matrices.iter().copied().zip(ys.iter_mut().map(|y| &mut y[..])).collect();
        matmul_many_quant(&two, &x, n, &mut scratch, &mut jobs);
    }
    for (i, (m, y)) in matrices.iter().zip(&ys).enumerate() {
        let rows = m.rows();
        let mut alone = vec![f32::NAN; n * rows];
        m.matmul(&one, &x, n, &mut scratch, &mut alone);
        assert!(same_bits(&alone, y), "matrix {i} ({}): fused on two threads vs alone on one", m.packing().name());
        for t in 0..n {
            // (1, cols) · (rows, cols)ᵀ -> (1, rows), token `t` alone.
            let mut lone = vec![f32::NAN; rows];
            m.matmul(&two, &x[t * cols..(t + 1) * cols], 1, &mut scratch, &mut lone);
            assert!(same_bits(&lone, &y[t * rows..(t + 1) * rows]), "matrix {i} token {t}: batch vs alone");
        }
    }
}

#[test]
fn a16_packings_are_not_quantized_from_floats() {
    for packing in PACKINGS {
        let result = std::panic::catch_unwind(|| {
            let data = vec![0u8; 16 * 64 * 4];
            let w = WeightMatrix { dtype: WeightDType::F32, rows: 16, cols: 64, data: &data };
            let mut out = QuantBuffer::zeroed(packing, 16, 64).expect("a valid shape");
            let (quants, scales) = out.planes_mut();
            QuantBuffer::quantize_groups(packing, w, 0..1, quants, scales, &mut vec![0.0; 64]);
        });
        assert!(result.is_err(), "{} refuses quantize_groups", packing.name());
    }
}

/// Without AVX-512 BF16 (capped here) the products run on the scalar tile, and without AMX
/// (`avx512`) on the AVX-512 BF16 tiles: the same accuracy and the same batch invariance.
#[test]
fn every_capped_family_passes_the_same_tests() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx512", "avx2", "scalar"] {
        for test in [
            "products_match_f64_over_the_exact_weights",
            "every_token_has_the_same_bits_alone_in_a_batch_fused_and_on_any_thread_count",
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
