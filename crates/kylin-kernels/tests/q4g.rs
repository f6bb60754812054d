//! Q4_G: the packing of a published 4-bit checkpoint's numbers (quants, per-sub-block scales
//! and mins) and its exact dequantization, the integer products against an independent
//! implementation of the canonical order (bit for bit, on every instruction set, any token
//! count and thread count), against f64 (the activations' quantization error only), every
//! token's outputs equal to the token computed alone, and fused products mixing the three
//! formats. Also the Q8_0 packer from integers against Q8_0's own quantization.

#[path = "support/rng.rs"]
mod rng;

use kylin_kernels::q4g::{
    Q4GMatrix, dequantize_row_q4_g, matmul_many_q4g, matmul_q4g_scalar, pack_q4_g, pack_q4_g_groups, q4_g_plane_lens,
};
use kylin_kernels::q4k::{QK_K, q4k_scratch_len};
use kylin_kernels::quant::{
    Packing, QuantBuffer, QuantMatrix, RowInput, dequantize_row_q8_0, matmul_many_quant, matmul_rows_quant, pack_q8_0,
    q8_0_plane_lens, quant_scratch_len, quantize_q8_0_groups, row_q8_0,
};
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix};
use rng::Rng;

/// A published checkpoint's numbers for a `[rows, cols]` matrix: quants `[rows, cols]` in
/// `0..=15` and f32 scales and mins `[rows, cols / 32]` (zero scales, zero and negative mins,
/// values that f16 rounds, and groups of 128 columns sharing a scale, as GPTQ's do).
struct Source {
    rows: usize,
    cols: usize,
    q: Vec<u8>,
    scales: Vec<f32>,
    mins: Vec<f32>,
}

impl Source {
    fn random(rng: &mut Rng, rows: usize, cols: usize) -> Source {
        let nb = cols / 32;
        let q = (0..rows * cols).map(|_| (rng.next_u64() % 16) as u8).collect();
        let (mut scales, mut mins) = (Vec::with_capacity(rows * nb), Vec::with_capacity(rows * nb));
        for r in 0..rows {
            for j in 0..nb {
                let (s, m) = match (r + j) % 7 {
                    // A zero scale: the sub-block's weights are all `−m`.
                    0 => (0.0, rng.next_f32()),
                    // A zero min.
                    1 => (rng.next_f32().abs() / 16.0, 0.0),
                    // A negative min (the zero point below zero).
                    2 => (rng.next_f32().abs() / 16.0, -rng.next_f32().abs()),
                    // GPTQ-like: a small positive scale, min = scale · z for a zero point in 0..16.
                    3 => {
                        let s = rng.next_f32().abs() / 256.0;
                        (s, s * (rng.next_u64() % 16) as f32)
                    }
                    // Four sub-blocks (a group of 128 columns) with the previous sub-block's numbers.
                    4 | 5 if j % 4 != 0 => (scales[r * nb + j - 1], mins[r * nb + j - 1]),
                    _ => (rng.next_f32(), rng.next_f32()),
                };
                scales.push(s);
                mins.push(m);
            }
        }
        Source { rows, cols, q, scales, mins }
    }

    /// The packed matrix, in two calls over split group ranges (as a loader packs in parallel).
    fn pack(&self) -> QuantBuffer {
        let (rows, cols) = (self.rows, self.cols);
        let mut out = QuantBuffer::zeroed(Packing::Q4G, rows, cols).expect("cols are a multiple of 64");
        let (gq, gs) = out.group_bytes();
        let groups = rows.div_ceil(16);
        let half = groups / 2;
        let (quants, scales) = out.planes_mut();
        let (qa, qb) = quants.split_at_mut(half * gq);
        let (sa, sb) = scales.split_at_mut(half * gs);
        pack_q4_g_groups(rows, cols, &self.q, &self.scales, &self.mins, 0..half, qa, sa);
        pack_q4_g_groups(rows, cols, &self.q, &self.scales, &self.mins, half..groups, qb, sb);
        out
    }

    /// Weight `(r, c)` as the format defines it: `f16(s) · q − f16(m)` in f32.
    fn weight(&self, r: usize, c: usize) -> f32 {
        let (s, m) = self.scale_min(r, c / 32);
        s * self.q[r * self.cols + c] as f32 - m
    }

    /// Row `r`'s sub-block `j` scale and min, rounded to f16 (nearest even) and widened.
    fn scale_min(&self, r: usize, j: usize) -> (f32, f32) {
        let at = r * (self.cols / 32) + j;
        (half::f16::from_f32(self.scales[at]).to_f32(), half::f16::from_f32(self.mins[at]).to_f32())
    }
}

#[test]
fn packing_round_trips_and_dequantizes_exactly() {
    let mut rng = Rng(7);
    for (rows, cols) in [(1, 64), (5, 128), (16, 64), (17, 896), (37, 1024), (3, 1024), (40, 320)] {
        let src = Source::random(&mut rng, rows, cols);
        let data = src.pack();
        let m = data.matrix().as_q4g().expect("q4_g");
        assert_eq!((m.rows(), m.cols()), (rows, cols));
        // One call over the whole matrix writes the same bytes as the split calls.
        let (lq, ls) = q4_g_plane_lens(rows, cols).expect("valid shape");
        let (mut quants, mut scales) = (vec![0xAAu8; lq], vec![0x55u8; ls]);
        pack_q4_g(rows, cols, &src.q, &src.scales, &src.mins, &mut quants, &mut scales);
        assert_eq!((&quants[..], &scales[..]), (m.quants(), m.scales()), "{rows}x{cols}: whole vs split packing");
        let mut deq = vec![f32::NAN; cols];
        let mut direct = vec![f32::NAN; cols];
        for r in 0..rows {
            data.matrix().dequantize_row(r, &mut deq);
            dequantize_row_q4_g(m, r, &mut direct);
            for c in 0..cols {
                let e = src.weight(r, c);
                assert_eq!(deq[c].to_bits(), e.to_bits(), "{rows}x{cols} row {r} col {c}: {} vs {e}", deq[c]);
                assert_eq!(direct[c].to_bits(), e.to_bits());
            }
        }
        // The padding rows of the last group are zero in both planes.
        let (gq, gs) = data.group_bytes();
        let (valid, groups) = (rows % 16, rows.div_ceil(16));
        if valid != 0 {
            let (last_q, last_s) = (&m.quants()[(groups - 1) * gq..], &m.scales()[(groups - 1) * gs..]);
            for (i, b) in last_q.iter().enumerate() {
                // `[pair][k4: 8][row: 16][4 columns]`: 64 bytes per k4, 4 per row.
                if (i % 64) / 4 >= valid {
                    assert_eq!(*b, 0, "{rows}x{cols}: padding quant byte {i}");
                }
            }
            for (i, b) in last_s.iter().enumerate() {
                // `[sub-block][scale: 16 f16][min: 16 f16]`: 2 bytes per row.
                if (i % 32) / 2 >= valid {
                    assert_eq!(*b, 0, "{rows}x{cols}: padding scale byte {i}");
                }
            }
        }
    }
    // Shapes and views.
    assert_eq!(Packing::Q4G as u8, 2);
    assert_eq!(Packing::Q4G.name(), "q4_g");
    assert_eq!(q4_g_plane_lens(3, 32), None);
    assert_eq!(q4_g_plane_lens(3, 0), None);
    assert_eq!(q4_g_plane_lens(usize::MAX, 1 << 20), None);
    assert_eq!(q4_g_plane_lens(17, 320), Some((2 * 5 * 512, 2 * 10 * 64)));
    assert_eq!(Packing::Q4G.plane_lens(17, 320), q4_g_plane_lens(17, 320));
    assert_eq!(Packing::Q4G.bits_per_weight(32, 1024), Some(5.0));
    assert!(Q4GMatrix::new(3, 64, &[0; 511], &[0; 128]).is_none());
    assert!(Q4GMatrix::new(3, 64, &[0; 512], &[0; 127]).is_none());
    assert!(Q4GMatrix::new(3, 96, &[0; 768], &[0; 192]).is_none());
    assert!(Q4GMatrix::new(3, 64, &[0; 512], &[0; 128]).is_some());
    assert!(QuantMatrix::new(Packing::Q4G, 3, 64, &[0; 512], &[0; 128]).and_then(|m| m.as_q4g()).is_some());
    assert!(QuantBuffer::zeroed(Packing::Q4G, usize::MAX / 2, 64).is_none());
}

#[test]
#[should_panic(expected = "q4_g is packed from a published checkpoint's own numbers")]
fn q4_g_is_not_quantized_from_floats() {
    let data = vec![0u8; 16 * 64 * 2];
    let w = WeightMatrix { dtype: WeightDType::BF16, rows: 16, cols: 64, data: &data };
    let mut out = QuantBuffer::zeroed(Packing::Q4G, 16, 64).expect("valid shape");
    let (quants, scales) = out.planes_mut();
    QuantBuffer::quantize_groups(Packing::Q4G, w, 0..1, quants, scales, &mut [0.0; 64]);
}

#[test]
#[should_panic(expected = "scales is not [rows, cols / 32]")]
fn packing_refuses_a_length_mismatch() {
    let (lq, ls) = q4_g_plane_lens(16, 64).expect("valid shape");
    let (mut quants, mut scales) = (vec![0u8; lq], vec![0u8; ls]);
    pack_q4_g(16, 64, &[0; 16 * 64], &[0.0; 31], &[0.0; 32], &mut quants, &mut scales);
}

/// The activation quantization of `q4k.rs` (which Q4_G shares), written independently: per
/// super-block `iscale = 127 / amax`, `q = round_ties_even(x · iscale)`, `dx = 1 / iscale`.
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

/// The canonical order, written independently of the library (from the source numbers, not
/// the packed planes): `(n, cols) · (rows, cols)ᵀ -> (n, rows)`.
fn canonical(src: &Source, x: &[f32], n: usize) -> Vec<f32> {
    let (rows, cols) = (src.rows, src.cols);
    let mut y = vec![0.0f32; n * rows];
    for t in 0..n {
        let xa = activations(&x[t * cols..(t + 1) * cols]);
        for r in 0..rows {
            let mut acc = 0.0f32;
            for (j, (xq, dx)) in xa.iter().enumerate() {
                let isum: i32 = (0..32).map(|k| src.q[r * cols + j * 32 + k] as i32 * xq[k]).sum();
                let bx = xq.iter().sum::<i32>() as f32 * dx;
                let (s, m) = src.scale_min(r, j);
                acc = (isum as f32).mul_add(s * dx, acc);
                acc = (-bx).mul_add(m, acc);
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
fn products_have_the_canonical_bits_and_the_expected_accuracy() {
    let mut rng = Rng(3);
    let pools: Vec<ThreadPool> = [1, 2, 3].into_iter().map(ThreadPool::new).collect();
    // (200, 1024) is large enough for the products to split across the pool's threads.
    for (rows, cols) in [(1, 64), (7, 128), (16, 320), (33, 576), (50, 896), (19, 1024), (200, 1024)] {
        let src = Source::random(&mut rng, rows, cols);
        let data = src.pack();
        let m = data.matrix().as_q4g().expect("q4_g");
        // 40 tokens: a prefill's path (weights unpacked once for every tile of 8 tokens).
        for n in (1..=20).chain([40]) {
            if rows * cols > 64 * 1024 && n % 3 != 1 && n != 20 {
                // The large matrix at a sample of token counts only (1, 4, 7, ..., 19, 20).
                continue;
            }
            let x = rng.vec(n * cols);
            let expected = canonical(&src, &x, n);
            for pool in &pools {
                let mut scratch = vec![0u8; q4k_scratch_len(n, cols)];
                let mut y = vec![f32::NAN; n * rows];
                // (n, cols) · (rows, cols)ᵀ -> (n, rows)
                matmul_many_q4g(pool, &x, n, &mut scratch, &mut [(m, &mut y)]);
                assert!(same_bits(&y, &expected), "{rows}x{cols} n={n} threads={}", pool.threads());
            }
            let mut scalar = vec![f32::NAN; n * rows];
            // (n, cols) · (rows, cols)ᵀ -> (n, rows) on the scalar tile.
            matmul_q4g_scalar(m, &x, n, &mut scalar);
            assert!(same_bits(&scalar, &expected), "{rows}x{cols} n={n}: scalar path");
            // Against the dequantized weights and f32 activations in f64: only the activations'
            // quantization separates them (half a step per element at most), plus rounding.
            let mut deq = vec![0.0f32; cols];
            for r in 0..rows {
                data.matrix().dequantize_row(r, &mut deq);
                for t in 0..n {
                    let xt = &x[t * cols..(t + 1) * cols];
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

/// A Q8_0 and a Q4_K matrix quantized from random BF16 weights.
fn quantized(rng: &mut Rng, packing: Packing, rows: usize, cols: usize) -> QuantBuffer {
    let source = rng.weights(WeightDType::BF16, rows * cols);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &source };
    let mut out = QuantBuffer::zeroed(packing, rows, cols).expect("a valid shape");
    let (quants, scales) = out.planes_mut();
    QuantBuffer::quantize_groups(packing, w, 0..rows.div_ceil(16), quants, scales, &mut vec![0.0; cols]);
    out
}

/// One fused call over Q8_0, Q4_K and Q4_G matrices sharing an input gives every matrix the
/// bits it gets alone, and every token the bits it gets alone (batch invariance).
#[test]
fn fused_formats_and_lone_tokens_agree() {
    let mut rng = Rng(5);
    // 384 columns: a partial super-block for Q4_K's scales and the activations.
    let cols = 384;
    let buffers = [
        quantized(&mut rng, Packing::Q8_0, 24, cols),
        Source::random(&mut rng, 40, cols).pack(),
        quantized(&mut rng, Packing::Q4K, 9, cols),
        Source::random(&mut rng, 70, cols).pack(),
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
        // Q4_K and Q4_G share one activation region: two int8 regions hold all three formats,
        // and the `_a16` packings' BF16 values and sums (2.125 bytes per column) take a third,
        // with a lone token's integer forms after it (3.5 bytes per column, once).
        assert_eq!(quant_scratch_len(n, cols), 2 * q4k_scratch_len(n, cols) + n * (2 * cols + cols / 8) + 7 * cols / 2);
    }
}

/// Matrices that each read their own input row (`matmul_rows_quant`, a decode step's routed
/// experts) give every matrix the bits it gets alone on its row: eleven jobs (two pool jobs
/// of up to eight), seven formats over all three activation kinds, rows read twice or not at
/// all, odd row counts; and the same over one input row (whose BF16 packing, under the AMX
/// family, adds the integer forms a lone token's products read).
#[test]
fn matrices_on_their_own_rows_agree_with_each_alone() {
    let mut rng = Rng(9);
    let cols = 512;
    let buffers = [
        quantized(&mut rng, Packing::Q8_0, 24, cols),
        Source::random(&mut rng, 40, cols).pack(),
        quantized(&mut rng, Packing::Q4K, 9, cols),
        quantized(&mut rng, Packing::Q6_0, 33, cols),
        quantized(&mut rng, Packing::Q5_0, 50, cols),
        {
            // BF16 activations over Q8_0's planes: the third activation region.
            let mut b = quantized(&mut rng, Packing::Q8_0, 20, cols);
            assert!(b.set_packing(Packing::Q8_0A16));
            b
        },
        {
            let mut b = Source::random(&mut rng, 30, cols).pack();
            assert!(b.set_packing(Packing::Q4GA16));
            b
        },
    ];
    // (matrix, input row) of each job.
    let plans: [&[(usize, usize)]; 2] = [
        &[(0, 6), (1, 0), (2, 3), (3, 3), (4, 1), (5, 2), (0, 2), (2, 0), (1, 5), (6, 4), (5, 4)],
        &[(5, 0), (6, 0), (0, 0), (1, 0)],
    ];
    for plan in plans {
        let inputs = plan.iter().map(|&(_, row)| row + 1).max().unwrap_or(0);
        rows_agree_with_each_alone(&mut rng, &buffers, inputs, cols, plan);
    }
}

fn rows_agree_with_each_alone(
    rng: &mut Rng,
    buffers: &[QuantBuffer],
    inputs: usize,
    cols: usize,
    plan: &[(usize, usize)],
) {
    let xs = rng.vec(inputs * cols);
    let pool = ThreadPool::new(2);
    let mut scratch = vec![0u8; quant_scratch_len(inputs, cols)];
    let mut ys: Vec<Vec<f32>> = plan.iter().map(|&(m, _)| vec![f32::NAN; buffers[m].matrix().rows()]).collect();
    {
        let mut jobs: Vec<(RowInput<'_>, &mut [f32])> = plan
            .iter()
            .zip(ys.iter_mut())
            .map(|(&(m, row), y)| (RowInput { matrix: buffers[m].matrix(), row }, &mut y[..]))
            .collect();
        // 11 × (1, cols) · (rows_i, cols)ᵀ -> (1, rows_i), input row row_i each, in one call.
        matmul_rows_quant(&pool, &xs, &mut scratch, &mut jobs);
    }
    for (job, (&(m, row), y)) in plan.iter().zip(&ys).enumerate() {
        let matrix = buffers[m].matrix();
        // (1, cols) · (rows, cols)ᵀ -> (1, rows), this matrix and row alone.
        let mut alone = vec![f32::NAN; matrix.rows()];
        matrix.matmul(&pool, &xs[row * cols..(row + 1) * cols], 1, &mut scratch, &mut alone);
        assert!(same_bits(&alone, y), "job {job} ({} on row {row}): grouped vs alone", matrix.packing().name());
    }
}

/// `pack_q8_0` writes exactly the planes `quantize_q8_0_groups` makes of weights `d · q` that
/// Q8_0 represents exactly (`d` an f16 and a `±127` in every block, or a block of zeros), and
/// those planes dequantize to the weights.
#[test]
fn pack_q8_0_is_q8_0s_quantization_of_representable_weights() {
    let mut rng = Rng(17);
    for (rows, cols) in [(1, 32), (16, 64), (37, 96), (5, 1024)] {
        let nb = cols / 32;
        let (mut q, mut scales) = (vec![0i8; rows * cols], vec![0.0f32; rows * nb]);
        for r in 0..rows {
            for b in 0..nb {
                if (r + b) % 5 == 0 {
                    // A block of zeros: scale 0, quants 0.
                    continue;
                }
                // A normal or subnormal f16 scale, positive as Q8_0's are.
                let d = half::f16::from_f32(rng.next_f32().abs() * 2f32.powi((rng.next_u64() % 20) as i32 - 16));
                scales[r * nb + b] = d.to_f32();
                let block = &mut q[r * cols + b * 32..r * cols + (b + 1) * 32];
                for v in block.iter_mut() {
                    *v = ((rng.next_u64() % 255) as i32 - 127) as i8;
                }
                block[(rng.next_u64() % 32) as usize] = if rng.next_u64().is_multiple_of(2) { 127 } else { -127 };
                if d.to_f32() == 0.0 {
                    block.fill(0);
                }
            }
        }
        let weights: Vec<u8> = q
            .iter()
            .enumerate()
            .flat_map(|(i, &v)| (scales[(i / cols) * nb + (i % cols) / 32] * v as f32).to_le_bytes())
            .collect();
        let w = WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &weights };
        let (lq, ls) = q8_0_plane_lens(rows, cols).expect("valid shape");
        let (mut eq, mut es) = (vec![0u8; lq], vec![0u8; ls]);
        quantize_q8_0_groups(w, 0..rows.div_ceil(16), &mut eq, &mut es, &mut vec![0.0; cols]);
        let (mut pq, mut ps) = (vec![0xAAu8; lq], vec![0x55u8; ls]);
        pack_q8_0(rows, cols, &q, &scales, &mut pq, &mut ps);
        assert!(pq == eq, "{rows}x{cols}: quants planes differ");
        assert!(ps == es, "{rows}x{cols}: scales planes differ");
        let m = QuantMatrix::new(Packing::Q8_0, rows, cols, &pq, &ps).and_then(|m| m.as_q8_0()).expect("q8_0");
        let mut deq = vec![f32::NAN; cols];
        for r in 0..rows {
            dequantize_row_q8_0(m, r, &mut deq);
            let row: Vec<f32> = weights[r * cols * 4..(r + 1) * cols * 4]
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            assert!(same_bits(&deq, &row), "{rows}x{cols} row {r}");
        }
    }
    // The whole int8 range survives the offset-binary storage, −128 included.
    let q: Vec<i8> = (0..64i32).map(|i| (i * 4 - 128) as i8).collect();
    let (lq, ls) = q8_0_plane_lens(1, 64).expect("valid shape");
    let (mut pq, mut ps) = (vec![0u8; lq], vec![0u8; ls]);
    pack_q8_0(1, 64, &q, &[0.5, 3.0e5], &mut pq, &mut ps);
    let m = QuantMatrix::new(Packing::Q8_0, 1, 64, &pq, &ps).and_then(|m| m.as_q8_0()).expect("q8_0");
    let (mut qs, mut bits) = (vec![0i8; 64], vec![0u16; 2]);
    row_q8_0(m, 0, &mut qs, &mut bits);
    assert_eq!(qs, q);
    // Scales round to f16 to nearest even (3.0e5 is beyond f16's range: infinity).
    assert_eq!(bits, [half::f16::from_f32(0.5).to_bits(), half::f16::INFINITY.to_bits()]);
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
            "packing_round_trips_and_dequantizes_exactly",
            "products_have_the_canonical_bits_and_the_expected_accuracy",
            "fused_formats_and_lone_tokens_agree",
            "pack_q8_0_is_q8_0s_quantization_of_representable_weights",
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
