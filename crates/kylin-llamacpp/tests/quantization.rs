//! Kylin's weight quantization against llama.cpp's own C code (`ggml_quantize_chunk`, which
//! `llama-quantize` calls; no importance matrix): the same bytes for Q8_0 and Q4_K blocks,
//! on random rows of every magnitude and on rows of a real checkpoint.

use kylin_kernels::q4k::{GGUF_BLOCK_BYTES, QK_K, quantize_row_q4_k_gguf};
use kylin_kernels::quant::{QK8_0, quantize_row_q8_0};
use llama_cpp_sys_2::{GGML_TYPE_Q4_K, GGML_TYPE_Q8_0, ggml_quantize_chunk};

/// llama.cpp's quantization of `rows` rows of `cols` columns of `x` to `ty`.
fn llama_cpp(ty: llama_cpp_sys_2::ggml_type, x: &[f32], rows: usize, cols: usize, row_bytes: usize) -> Vec<u8> {
    let mut out = vec![0u8; rows * row_bytes];
    // SAFETY: `x` holds `rows · cols` floats and `out` `rows` rows of `ty`'s row size
    // (`row_bytes`, checked against the returned size); no importance matrix.
    let written = unsafe {
        ggml_quantize_chunk(ty, x.as_ptr(), out.as_mut_ptr().cast(), 0, rows as i64, cols as i64, std::ptr::null())
    };
    assert_eq!(written, out.len());
    out
}

/// Rows of mixed scale: typical weights, rows with outliers, tiny and zero sub-blocks.
fn rows(rows: usize, cols: usize, seed: u64) -> Vec<f32> {
    let mut state = seed;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let mut x: Vec<f32> = (0..rows * cols).map(|_| next() * 0.05).collect();
    for r in 0..rows {
        let row = &mut x[r * cols..(r + 1) * cols];
        match r % 5 {
            1 => row[(r * 37) % cols] = 1.5,
            2 => row.iter_mut().for_each(|v| *v = v.abs()),
            3 => row[..32].fill(0.0),
            4 => row.iter_mut().step_by(3).for_each(|v| *v *= 1e-4),
            _ => {}
        }
    }
    x
}

#[test]
fn q4_k_blocks_are_llama_cpps() {
    for (n_rows, cols, seed) in [(20, 256, 1), (10, 1024, 2), (7, 4864, 3)] {
        let x = rows(n_rows, cols, seed);
        let row_bytes = cols / QK_K * GGUF_BLOCK_BYTES;
        let theirs = llama_cpp(GGML_TYPE_Q4_K, &x, n_rows, cols, row_bytes);
        let mut ours = vec![0u8; row_bytes];
        for r in 0..n_rows {
            quantize_row_q4_k_gguf(&x[r * cols..(r + 1) * cols], &mut ours);
            for (b, (a, e)) in ours.chunks(144).zip(theirs[r * row_bytes..(r + 1) * row_bytes].chunks(144)).enumerate()
            {
                assert_eq!(a, e, "{cols} columns, row {r}, super-block {b}");
            }
        }
    }
}

#[test]
fn q8_0_blocks_are_llama_cpps() {
    for (n_rows, cols, seed) in [(20, 32, 4), (10, 896, 5), (5, 4864, 6)] {
        let x = rows(n_rows, cols, seed);
        let row_bytes = cols / QK8_0 * 34;
        let theirs = llama_cpp(GGML_TYPE_Q8_0, &x, n_rows, cols, row_bytes);
        let (mut qs, mut scales) = (vec![0i8; cols], vec![0u16; cols / QK8_0]);
        for r in 0..n_rows {
            quantize_row_q8_0(&x[r * cols..(r + 1) * cols], &mut qs, &mut scales);
            for b in 0..cols / QK8_0 {
                let block = &theirs[r * row_bytes + b * 34..r * row_bytes + (b + 1) * 34];
                assert_eq!(u16::from_le_bytes([block[0], block[1]]), scales[b], "row {r} block {b} scale");
                let q: Vec<i8> = block[2..].iter().map(|&v| v as i8).collect();
                assert_eq!(&q[..], &qs[b * QK8_0..(b + 1) * QK8_0], "row {r} block {b}");
            }
        }
    }
}
