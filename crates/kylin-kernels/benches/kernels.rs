//! Kernel micro-benchmarks (divan), with throughput: bytes of weights streamed per second for
//! the GEMV (decode) and multiply-adds per second for the GEMM (prefill).
//!
//! `cargo bench -p kylin-kernels --bench kernels` (add `-- gemv` to pick; `-- quant` for the
//! quantized products). Shapes are the Qwen3-0.6B projections:
//! - `layer_bf16` and `tokens_3072x1024_bf16` sweep the token count through the f32-precision
//!   path (BF16 weights widened; `--precision f32`); `KYLIN_KERNELS_ISA=avx2` measures the AVX2
//!   path on an AVX-512 machine;
//! - `model_bf16_dot` and `gate_bf16_dot` run the engine's default `--precision bf16` path
//!   (AMX or `vdpbf16ps`): the first streams all 28 layers' weights from memory as batched
//!   decode does, the second keeps one matrix in cache and measures the kernel's compute rate;
//! - `model_bf16_decode` streams all 28 layers' BF16 weights through the GEMV, one decode token
//!   on the `--precision f32` path;
//! - `head` is the 151936-row output head (311 MB in BF16, far beyond every cache, so it
//!   measures memory bandwidth);
//! - `paged_attention_model` is one decode step's attention over a model-shaped paged cache.
//!
//! `KYLIN_BENCH_THREADS` sets the pool size (default: physical cores).

use divan::counter::{BytesCount, ItemsCount};
use divan::{Bencher, black_box};
use kylin_kernels::paged::AttentionNeeds;
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix};

fn main() {
    divan::main();
}

fn threads() -> usize {
    std::env::var("KYLIN_BENCH_THREADS").ok().and_then(|v| v.parse().ok()).unwrap_or_else(kylin_kernels::physical_cores)
}

/// Deterministic weights of `n` elements in `dtype` (values in about [-1, 1)).
fn weights(dtype: WeightDType, n: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut out = Vec::with_capacity(n * dtype.size_in_bytes());
    for _ in 0..n {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let v = (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
        match dtype {
            WeightDType::F32 => out.extend_from_slice(&v.to_le_bytes()),
            WeightDType::F16 => out.extend_from_slice(&half::f16::from_f32(v).to_le_bytes()),
            WeightDType::BF16 => out.extend_from_slice(&half::bf16::from_f32(v).to_le_bytes()),
        }
    }
    out
}

/// `n` FP8 E4M3 codes: the nearest (ties away from zero) to [`weights`]' uniform values in
/// `[-1, 1)` times 448, E4M3's largest.
fn e4m3_codes(n: usize) -> Vec<u8> {
    let values = weights(WeightDType::F32, n);
    values
        .chunks_exact(4)
        .map(|v| {
            let v = f32::from_le_bytes([v[0], v[1], v[2], v[3]]) * 448.0;
            let sign = if v < 0.0 { 0x80 } else { 0 };
            let a = v.abs();
            // Subnormals: multiples of 2^-9 below 2^-6 (the code's low bits are the multiple).
            let code = if a < (2.0f32).powi(-6) {
                (a * 512.0).round() as u32
            } else {
                let e = (a.to_bits() >> 23) as i32 - 127;
                let q = ((a / (2.0f32).powi(e) - 1.0) * 8.0).round() as i32;
                (((e + 7) << 3) + q).min(0x7E) as u32
            };
            sign | code as u8
        })
        .collect()
}

/// `(name, rows, cols)` of the Qwen3-0.6B matrices.
const SHAPES: [(&str, usize, usize); 4] =
    [("q_proj", 2048, 1024), ("gate_proj", 3072, 1024), ("down_proj", 1024, 3072), ("head", 151_936, 1024)];

#[divan::bench(args = SHAPES, consts = [0, 1, 2])]
fn gemv<const D: u8>(bencher: Bencher, shape: (&str, usize, usize)) {
    let dtype = [WeightDType::BF16, WeightDType::F16, WeightDType::F32][D as usize];
    let (_, rows, cols) = shape;
    let pool = ThreadPool::new(threads());
    let data = weights(dtype, rows * cols);
    let w = WeightMatrix { dtype, rows, cols, data: &data };
    let x = vec![0.5f32; cols];
    let mut y = vec![0.0f32; rows];
    bencher
        .counter(BytesCount::new(data.len()))
        .bench_local(|| kylin_kernels::matmul(&pool, w, black_box(&x), 1, black_box(&mut y)));
}

/// `(name, rows, cols)` of one Qwen3-0.6B layer's matmuls as the engine runs them (q/k/v fused).
const LAYER: [(&str, usize, usize); 5] = [
    ("qkv_proj", 4096, 1024),
    ("o_proj", 1024, 2048),
    ("gate_proj", 3072, 1024),
    ("up_proj", 3072, 1024),
    ("down_proj", 1024, 3072),
];

/// One `(rows, cols)` matrix's deterministic BF16 weights, and `tokens` tokens of input and of
/// output.
fn layer_operands(rows: usize, cols: usize, tokens: usize) -> (Vec<u8>, Vec<f32>, Vec<f32>) {
    (weights(WeightDType::BF16, rows * cols), vec![0.5f32; tokens * cols], vec![0.0f32; tokens * rows])
}

#[divan::bench(args = LAYER, consts = [512])]
fn gemm_bf16<const TOKENS: usize>(bencher: Bencher, shape: (&str, usize, usize)) {
    let (_, rows, cols) = shape;
    let pool = ThreadPool::new(threads());
    let (data, x, mut y) = layer_operands(rows, cols, TOKENS);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
    // One item is one multiply-add: GFLOP/s is twice the items per second.
    bencher
        .counter(ItemsCount::new(rows * cols * TOKENS))
        .bench_local(|| kylin_kernels::matmul(&pool, w, black_box(&x), TOKENS, black_box(&mut y)));
}

#[divan::bench(args = LAYER, consts = [1, 8, 512])]
fn gemm_strips_bf16<const TOKENS: usize>(bencher: Bencher, shape: (&str, usize, usize)) {
    use kylin_kernels::strips::{StripBuffer, matmul_many_strips};
    let (_, rows, cols) = shape;
    let pool = ThreadPool::new(threads());
    let (data, x, mut y) = layer_operands(rows, cols, TOKENS);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
    let strips = StripBuffer::pack(w).expect("a whole matrix");
    bencher.counter(ItemsCount::new(rows * cols * TOKENS)).bench_local(|| {
        matmul_many_strips(&pool, black_box(&x), TOKENS, &mut [(strips.matrix(), black_box(&mut y[..]))])
    });
}

/// One layer's matmuls (as [`gemm_bf16`]) on the engine's default `--precision bf16` path
/// ([`kylin_kernels::matmul_many_bf16`]: AMX or `vdpbf16ps`), a prefill's 512 tokens: each
/// matrix's compute rate (the activations are rounded to BF16 inside the call, as in the engine).
#[divan::bench(args = LAYER, consts = [512])]
fn gemm_dpbf16<const TOKENS: usize>(bencher: Bencher, shape: (&str, usize, usize)) {
    use kylin_kernels::{bf16_kernels, bf16_scratch_len, matmul_many_bf16};
    let Some(kernels) = bf16_kernels() else { return };
    let (_, rows, cols) = shape;
    let pool = ThreadPool::new(threads());
    let (data, x, mut y) = layer_operands(rows, cols, TOKENS);
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
    let mut scratch = vec![0u16; bf16_scratch_len(TOKENS, cols)];
    bencher
        .counter(ItemsCount::new(rows * cols * TOKENS))
        .bench_local(|| matmul_many_bf16(&pool, kernels, black_box(&x), TOKENS, &mut scratch, &mut [(w, &mut y[..])]));
}

/// Qwen3-0.6B's 3072×1024 gate projection in BF16, with `tokens` tokens of input and output.
struct Gate {
    data: Vec<u8>,
    x: Vec<f32>,
    y: Vec<f32>,
}

impl Gate {
    const ROWS: usize = 3072;
    const COLS: usize = 1024;

    fn new(tokens: usize) -> Self {
        Gate {
            data: weights(WeightDType::BF16, Self::ROWS * Self::COLS),
            x: vec![0.5f32; tokens * Self::COLS],
            y: vec![0.0f32; tokens * Self::ROWS],
        }
    }

    fn matrix(data: &[u8]) -> WeightMatrix<'_> {
        WeightMatrix { dtype: WeightDType::BF16, rows: Self::ROWS, cols: Self::COLS, data }
    }
}

/// Batched decode and short prefills: one 3072×1024 BF16 matrix for `TOKENS` tokens (the GEMV
/// for one token, the GEMM from two), weights counted once per call.
#[divan::bench(consts = [1, 2, 4, 8, 16, 32, 64, 512])]
fn tokens_3072x1024_bf16<const TOKENS: usize>(bencher: Bencher) {
    let pool = ThreadPool::new(threads());
    let Gate { data, x, mut y } = Gate::new(TOKENS);
    let w = Gate::matrix(&data);
    bencher
        .counter(ItemsCount::new(Gate::ROWS * Gate::COLS * TOKENS))
        .bench_local(|| kylin_kernels::matmul(&pool, w, black_box(&x), TOKENS, black_box(&mut y)));
}

/// One whole layer (the five matmuls of [`LAYER`]) for `TOKENS` tokens.
#[divan::bench(consts = [1, 2, 4, 8, 16, 32, 64, 512])]
fn layer_bf16<const TOKENS: usize>(bencher: Bencher) {
    let pool = ThreadPool::new(threads());
    let datas: Vec<Vec<u8>> = LAYER.iter().map(|(_, r, c)| weights(WeightDType::BF16, r * c)).collect();
    let ws: Vec<WeightMatrix<'_>> = LAYER
        .iter()
        .zip(&datas)
        .map(|((_, rows, cols), data)| WeightMatrix { dtype: WeightDType::BF16, rows: *rows, cols: *cols, data })
        .collect();
    let xs: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.5f32; TOKENS * w.cols]).collect();
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| vec![0.0f32; TOKENS * w.rows]).collect();
    let macs: usize = ws.iter().map(|w| w.rows * w.cols * TOKENS).sum();
    bencher.counter(ItemsCount::new(macs)).bench_local(|| {
        for ((w, x), y) in ws.iter().zip(&xs).zip(ys.iter_mut()) {
            kylin_kernels::matmul(&pool, *w, black_box(x), TOKENS, black_box(y));
        }
    });
}

/// Quantized products (`matmul_many_quant`) on one 1024×1024 matrix for `TOKENS` tokens, by
/// format: `q8_0`, `q4_k`, `q5_0` and `q6_0` quantized from BF16 weights (`--quantize q4_k`
/// makes Q5_0 of matrices whose columns are not whole super-blocks, Q6_0 of the head and of
/// some `v_proj` and `down_proj`), `q4_g` packed from GPTQ-like numbers (a scale and a zero
/// point per 128 columns). The matrix stays in the caches, so this measures the tiles'
/// arithmetic. For one token the counter is the bytes of the packed planes streamed, for more
/// the multiply-adds.
#[divan::bench(args = ["q8_0", "q4_k", "q4_g", "q4_g_a16", "q5_0", "q6_0"], consts = [1, 64])]
fn quant_1024x1024<const TOKENS: usize>(bencher: Bencher, format: &str) {
    use kylin_kernels::quant::{Packing, QuantBuffer, quant_scratch_len};
    let (rows, cols) = (1024, 1024);
    let pool = ThreadPool::new(threads());
    let packing = match format {
        "q8_0" => Packing::Q8_0,
        "q4_k" => Packing::Q4K,
        "q5_0" => Packing::Q5_0,
        "q6_0" => Packing::Q6_0,
        "q4_g_a16" => Packing::Q4GA16,
        _ => Packing::Q4G,
    };
    let mut buffer = QuantBuffer::zeroed(packing, rows, cols).expect("a valid shape");
    let (quants, scales) = buffer.planes_mut();
    if matches!(packing, Packing::Q4G | Packing::Q4GA16) {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let q: Vec<u8> = (0..rows * cols).map(|_| (next() % 16) as u8).collect();
        // One scale and zero point per 128 columns (4 sub-blocks), as GPTQ's group size 128.
        let group: Vec<(f32, f32)> = (0..rows * cols / 128)
            .map(|_| {
                let s = 1e-3 + (next() % 1000) as f32 * 1e-5;
                (s, s * (next() % 16) as f32)
            })
            .collect();
        let sub_scales: Vec<f32> = (0..rows * cols / 32).map(|i| group[i / 4].0).collect();
        let sub_mins: Vec<f32> = (0..rows * cols / 32).map(|i| group[i / 4].1).collect();
        kylin_kernels::q4g::pack_q4_g(rows, cols, &q, &sub_scales, &sub_mins, quants, scales);
    } else {
        let data = weights(WeightDType::BF16, rows * cols);
        let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
        QuantBuffer::quantize_groups(packing, w, 0..rows / 16, quants, scales, &mut vec![0.0; cols]);
    }
    let m = buffer.matrix();
    let x: Vec<f32> = (0..TOKENS * cols).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut scratch = vec![0u8; quant_scratch_len(TOKENS, cols)];
    let mut y = vec![0.0f32; TOKENS * rows];
    let bencher = if TOKENS == 1 {
        bencher.counter(BytesCount::new(m.byte_len()))
    } else {
        bencher.counter(ItemsCount::new(rows * cols * TOKENS))
    };
    // (TOKENS, 1024) · (1024, 1024)ᵀ -> (TOKENS, 1024)
    bencher.bench_local(|| m.matmul(&pool, black_box(&x), TOKENS, &mut scratch, black_box(&mut y)));
}

/// `copies` sets of matrices of `shapes` `(rows, cols)` in `packing`, as `--quantize` makes
/// them, one set after another: one set quantized from seeded BF16 weights, its planes copied
/// into every set's own buffers (far beyond every cache, so each product streams from memory).
fn quantized_copies(
    packing: kylin_kernels::quant::Packing,
    shapes: &[(usize, usize)],
    copies: usize,
) -> Vec<kylin_kernels::quant::QuantBuffer> {
    use kylin_kernels::quant::QuantBuffer;
    let zeroed = |rows, cols| QuantBuffer::zeroed(packing, rows, cols).expect("a valid shape");
    let first: Vec<QuantBuffer> = shapes
        .iter()
        .map(|&(rows, cols)| {
            let mut buffer = zeroed(rows, cols);
            let (quants, scales) = buffer.planes_mut();
            if loadable_only(packing) {
                // A published format is packed from a checkpoint's tensors, not quantized at load:
                // deterministic bytes stand in. The products' speed does not depend on them,
                // except FP8's on how often a block holds a subnormal code: its codes are the
                // nearest to uniform weights scaled to E4M3's largest, as a checkpoint's are,
                // packed as the engine packs them (`pack_f8` marks the blocks with a subnormal)
                // with positive scales, as a checkpoint's are.
                if packing == kylin_kernels::quant::Packing::F8A16 {
                    let codes = e4m3_codes(rows * cols);
                    let block_scales: Vec<f32> =
                        (0..rows * (cols / 32)).map(|i| (1.0 + (i % 7) as f32 / 8.0) / 448.0).collect();
                    kylin_kernels::w16::pack_f8(rows, cols, &codes, &block_scales, quants, scales);
                    return buffer;
                }
                quants.copy_from_slice(&weights(WeightDType::BF16, quants.len() / 2));
                scales.copy_from_slice(&weights(WeightDType::BF16, scales.len() / 2));
                return buffer;
            }
            let data = weights(WeightDType::BF16, rows * cols);
            let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
            QuantBuffer::quantize_groups(packing, w, 0..rows / 16, quants, scales, &mut vec![0.0; cols]);
            buffer
        })
        .collect();
    (0..copies)
        .flat_map(|_| {
            first.iter().zip(shapes).map(|(source, &(rows, cols))| {
                let mut buffer = zeroed(rows, cols);
                let (quants, scales) = buffer.planes_mut();
                let from = source.matrix();
                quants.copy_from_slice(from.quants());
                scales.copy_from_slice(from.scales());
                buffer
            })
        })
        .collect()
}

/// Whether `packing` is only ever packed from a published checkpoint (no quantization at load
/// makes it).
fn loadable_only(packing: kylin_kernels::quant::Packing) -> bool {
    use kylin_kernels::quant::Packing;
    matches!(packing, Packing::Q4G | Packing::Q8_0A16 | Packing::Q4GA16 | Packing::F8A16 | Packing::Mxfp4)
}

/// One decode token through all 28 layers of Qwen3-0.6B quantized at load
/// ([`kylin_kernels::quant::QuantBuffer`], as `--quantize` makes them: far beyond every cache,
/// so each call streams the planes from memory as a decode step does), by format. Counted in
/// bytes of the planes read.
#[divan::bench(args = ["q8_0", "q4_k", "q5_0", "q6_0", "q4_g", "q4_g_a16", "q8_0_a16", "f8_a16", "mxfp4"], sample_count = 30)]
fn model_quant_decode(bencher: Bencher, format: &str) {
    use kylin_kernels::quant::{Packing, quant_scratch_len};
    const LAYERS: usize = 28;
    let pool = ThreadPool::new(threads());
    let packing = match format {
        "q8_0" => Packing::Q8_0,
        "q4_k" => Packing::Q4K,
        "q5_0" => Packing::Q5_0,
        "q6_0" => Packing::Q6_0,
        "q4_g" => Packing::Q4G,
        "q4_g_a16" => Packing::Q4GA16,
        "q8_0_a16" => Packing::Q8_0A16,
        "f8_a16" => Packing::F8A16,
        _ => Packing::Mxfp4,
    };
    let buffers = quantized_copies(packing, &QWEN3_LAYER, LAYERS);
    let x: Vec<f32> = (0..3072).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut scratch = vec![0u8; quant_scratch_len(1, 3072)];
    let mut y = vec![0.0f32; 3072];
    let bytes: usize = buffers.iter().map(|b| b.matrix().byte_len()).sum();
    bencher.counter(BytesCount::new(bytes)).bench_local(|| {
        for b in &buffers {
            let m = b.matrix();
            // (1, cols) · (cols, rows)ᵀ -> (1, rows)
            m.matmul(&pool, black_box(&x[..m.cols()]), 1, &mut scratch, black_box(&mut y[..m.rows()]));
        }
    });
}

/// The routed experts of one decode token through 4 layers of Qwen3-30B-A3B's shapes (128
/// experts of `[768, 2048]` gate and up and `[2048, 768]` down per layer, 8 routed per token,
/// a different 8 at every call) quantized to Q4_K at load (0.9 MB each, below a huge page: parts
/// of `AlignedBytes`' arena chunks), by how the products are dispatched: `per_expert`, one pool dispatch per matrix (the engine's
/// path for an expert with several tokens, `moe.rs` `run_expert`); `grouped`, one dispatch for
/// each kind of matrix over all 8 routed experts, the downs each on its own input row
/// (`matmul_many_quant` and `matmul_rows_quant`, the engine's path for one token). Counted in
/// bytes of the planes read.
#[divan::bench(args = ["per_expert", "grouped"], sample_count = 30)]
fn moe_quant_decode(bencher: Bencher, dispatch: &str) {
    use kylin_kernels::quant::{
        Packing, QuantMatrix, RowInput, matmul_many_quant, matmul_rows_quant, quant_scratch_len,
    };
    const LAYERS: usize = 4;
    const EXPERTS: usize = 128;
    const ROUTED: usize = 8;
    let pool = ThreadPool::new(threads());
    // One expert's matrices `(rows, cols)`: gate, up, down.
    let shapes = [(768, 2048), (768, 2048), (2048, 768)];
    let buffers = quantized_copies(Packing::Q4K, &shapes, LAYERS * EXPERTS);
    let x: Vec<f32> = (0..2048).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    // The downs' inputs: one row of 768 activations per routed expert.
    let acts: Vec<f32> = (0..ROUTED * 768).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut scratch = vec![0u8; quant_scratch_len(ROUTED, 2048)];
    let mut ys = vec![0.0f32; ROUTED * 2048];
    let bytes: usize = LAYERS * ROUTED * buffers[..3].iter().map(|b| b.matrix().byte_len()).sum::<usize>();
    // A spread of experts that changes at every call, as routing does.
    let expert = |call: usize, layer: usize, k: usize| (call * 37 + layer * 11 + k * 16) % EXPERTS;
    let mut call = 0usize;
    let grouped = dispatch == "grouped";
    bencher.counter(BytesCount::new(bytes)).bench_local(|| {
        call += 1;
        for layer in 0..LAYERS {
            for kind in 0..3 {
                let mut jobs: [Option<(QuantMatrix<'_>, &mut [f32])>; ROUTED] = Default::default();
                for ((k, y), job) in ys.chunks_mut(2048).enumerate().zip(jobs.iter_mut()) {
                    let m = buffers[(layer * EXPERTS + expert(call, layer, k)) * 3 + kind].matrix();
                    *job = Some((m, &mut y[..m.rows()]));
                }
                let mut jobs = jobs.map(|job| job.expect("one per routed expert"));
                let cols = jobs[0].0.cols();
                match (grouped, kind) {
                    // 8 × (1, 2048) · (2048, 768)ᵀ -> (1, 768), one dispatch.
                    (true, 0 | 1) => matmul_many_quant(&pool, black_box(&x[..cols]), 1, &mut scratch, &mut jobs),
                    // 8 × (1, 768) · (768, 2048)ᵀ -> (1, 2048), expert k on row k, one dispatch.
                    (true, _) => {
                        let mut row = 0;
                        let mut downs = jobs.map(|(matrix, y)| {
                            row += 1;
                            (RowInput { matrix, row: row - 1 }, y)
                        });
                        matmul_rows_quant(&pool, black_box(&acts), &mut scratch, &mut downs);
                    }
                    _ => {
                        for (k, job) in jobs.chunks_mut(1).enumerate() {
                            let input = if kind == 2 { &acts[k * cols..(k + 1) * cols] } else { &x[..cols] };
                            // (1, cols) · (cols, rows)ᵀ -> (1, rows)
                            matmul_many_quant(&pool, black_box(input), 1, &mut scratch, job);
                        }
                    }
                }
            }
        }
    });
}

#[divan::bench(args = [64, 576, 4096])]
fn attention_head(bencher: Bencher, len: usize) {
    let hd = 128;
    let q = vec![0.1f32; hd];
    let k = vec![0.2f32; len * hd];
    let v = vec![0.3f32; len * hd];
    let mut scores = vec![0.0f32; len];
    let mut out = vec![0.0f32; hd];
    bencher
        .counter(BytesCount::new(2 * len * hd * 4))
        .bench_local(|| kylin_kernels::attention_head(&q, black_box(&k), &v, len, hd, 0.088, &mut scores, &mut out));
}

#[divan::bench]
fn rms_norm(bencher: Bencher) {
    let x = vec![0.3f32; 1024];
    let w = weights(WeightDType::BF16, 1024);
    let w = kylin_kernels::WeightVector { dtype: WeightDType::BF16, data: &w };
    let mut out = vec![0.0f32; 1024];
    bencher
        .counter(BytesCount::new(1024usize * 4))
        .bench_local(|| kylin_kernels::rms_norm(black_box(&x), w, 1e-6, &mut out));
}

/// Blocked attention over a paged BF16 cache (Qwen3-0.6B's head size, one KV head):
/// `(rows, len, block size)` = query rows of one call (2: a decode step of a GQA group of two;
/// 48: a prefill chunk) over `len` cached positions, under `--precision bf16` (the AMX path
/// where the CPU has it, its wide variant at block size 32; the AVX-512 BF16 path where it has
/// `vdpbf16ps` but no AMX; the f32 path with `KYLIN_BF16_ATTENTION=0`).
/// Bytes counted: the keys and values read once.
#[divan::bench(args = [(2, 512, 16), (2, 512, 32), (2, 3584, 16), (2, 3584, 32), (48, 512, 16), (48, 512, 32), (48, 3584, 16), (48, 3584, 32)])]
fn paged_attention_bf16(bencher: Bencher, shape: (usize, usize, usize)) {
    paged_attention(bencher, shape, None, AttentionNeeds::NONE);
}

/// [`paged_attention_bf16`] for a Gemma-2-style layer: a sliding window of 1024 positions
/// (only the window is read) and scores soft-capped at 50, on the path that supports both
/// (not AMX's). Bytes counted: the keys and values of the window read once.
#[divan::bench(args = [(2, 3584, 16), (2, 3584, 32), (48, 3584, 16), (48, 3584, 32)])]
fn paged_attention_bf16_window_softcap(bencher: Bencher, shape: (usize, usize, usize)) {
    paged_attention(bencher, shape, Some((1024, 50.0)), AttentionNeeds { window: true, softcap: true });
}

/// The body of the paged attention benchmarks: `window_cap` is a window of positions and a
/// soft cap.
fn paged_attention(
    bencher: Bencher,
    (n, len, bs): (usize, usize, usize),
    window_cap: Option<(usize, f32)>,
    needs: AttentionNeeds,
) {
    use kylin_kernels::paged::{KvView, QueryRow, ScoreMap, attention_path, attention_rows};
    let hd = 128;
    let blocks: Vec<u32> = (0..len.div_ceil(bs) as u32).rev().collect();
    // The pool is 64-byte aligned, as the engine's is.
    let raw = weights(WeightDType::BF16, blocks.len() * bs * hd);
    let mut pool = kylin_kernels::aligned::AlignedBytes::zeroed(raw.len()).expect("a small pool");
    pool.copy_from_slice(&raw);
    let data = &*pool;
    let layout = attention_path(kylin_kernels::Precision::Bf16, WeightDType::BF16, hd, bs, needs).layout();
    let kv = KvView { dtype: WeightDType::BF16, layout, data, block_stride: bs * hd, block_size: bs, head_dim: hd };
    let q = vec![0.1f32; n * hd];
    let mut out = vec![0.0f32; n * hd];
    let map = ScoreMap { scale: 0.088, softcap: window_cap.map(|(_, cap)| cap) };
    let window = window_cap.map_or(len, |(w, _)| w);
    bencher.counter(BytesCount::new(2 * window.min(len) * hd * 2)).bench_local(|| {
        let mut rows: Vec<QueryRow<'_>> = q
            .chunks_exact(hd)
            .zip(out.chunks_exact_mut(hd))
            .enumerate()
            .map(|(i, (q, out))| {
                let row_len = len - n + 1 + i;
                QueryRow { q, from: row_len.saturating_sub(window), len: row_len, out }
            })
            .collect();
        attention_rows(&mut rows, kv, kv, black_box(&blocks), 0, map);
    });
}

/// One decode step's attention over a whole model's paged cache, laid out as the engine's pool
/// is (a block holds every layer and KV head, so one (layer, head) tile of each block is read
/// and the next lies a block's stride away): every (layer, KV head) in turn, its query rows
/// (the heads of one GQA group) over all `len` positions, split over two threads by (layer,
/// head). `(model, cache)`: `qwen3` is Qwen3-0.6B at a 2k context (28 layers, 8 KV heads of
/// 128, 2 query rows each), `gemma3` Gemma-3-1B's global attention at 16k (26 layers, one KV
/// head of 256, 4 query rows), `gemma4` Gemma-4-E2B's full-attention layers at 16k (seven
/// layers read a cache of one KV head of 512, 8 query rows each), `coder` Qwen2.5-Coder-0.5B
/// at a 1k context (24 layers, 2 KV heads of 64, 7 query rows each); `bf16` is the default
/// precision's cache (the AVX-512 BF16 or AMX path; on a CPU with neither, the f32 path over
/// BF16), `f16` the `--quantize` engines' (the f32 path), `f32` the cache of `--precision f32`
/// over BF16 weights, the default on such a CPU. Bytes counted: the keys and values.
#[divan::bench(
    args = [
        ("qwen3", "bf16"),
        ("qwen3", "f16"),
        ("qwen3", "f32"),
        ("gemma3", "bf16"),
        ("gemma3", "f16"),
        ("gemma4", "bf16"),
        ("coder", "f16"),
    ],
    sample_count = 20
)]
fn paged_attention_model(bencher: Bencher, (model, cache): (&str, &str)) {
    use kylin_kernels::paged::{KvView, QueryRow, ScoreMap, attention_path, attention_rows};
    let (hd, kv_heads, layers, len, n): (usize, usize, usize, usize, usize) = match model {
        "qwen3" => (128, 8, 28, 2048, 2),
        "gemma3" => (256, 1, 26, 16384, 4),
        "coder" => (64, 2, 24, 1024, 7),
        _ => (512, 1, 7, 16384, 8),
    };
    let (dtype, precision) = match cache {
        "bf16" => (WeightDType::BF16, kylin_kernels::Precision::Bf16),
        "f32" => (WeightDType::F32, kylin_kernels::Precision::F32),
        _ => (WeightDType::F16, kylin_kernels::Precision::F32),
    };
    let bs = 16;
    let layout = attention_path(precision, dtype, hd, bs, AttentionNeeds::NONE).layout();
    let blocks: Vec<u32> = (0..len.div_ceil(bs) as u32).collect();
    let stride = layers * kv_heads * bs * hd;
    let pool = |seed: usize| {
        let bytes = blocks.len() * stride * dtype.size_in_bytes();
        let mut pool = kylin_kernels::aligned::AlignedBytes::zeroed(bytes).expect("a pool in memory");
        let tile = weights(dtype, bs * hd);
        for (i, chunk) in pool.chunks_exact_mut(tile.len()).enumerate() {
            chunk.copy_from_slice(&tile);
            chunk[0] = (i + seed) as u8;
        }
        pool
    };
    let (kpool, vpool) = (pool(0), pool(1));
    let view = |data| KvView { dtype, layout, data, block_stride: stride, block_size: bs, head_dim: hd };
    let (keys, values) = (view(&kpool[..]), view(&vpool[..]));
    let map = ScoreMap::scaled(1.0 / (hd as f32).sqrt());
    let sweep = |thread: usize| {
        let q = vec![0.1f32; n * hd];
        let mut out = vec![0.0f32; n * hd];
        for tile in (thread..layers * kv_heads).step_by(2) {
            let mut rows: Vec<QueryRow<'_>> = q
                .chunks_exact(hd)
                .zip(out.chunks_exact_mut(hd))
                .map(|(q, out)| QueryRow { q, from: 0, len, out })
                .collect();
            attention_rows(&mut rows, keys, values, black_box(&blocks), tile * bs * hd, map);
        }
    };
    bencher.counter(BytesCount::new(2 * layers * kv_heads * len * hd * dtype.size_in_bytes())).bench_local(|| {
        std::thread::scope(|s| {
            s.spawn(|| sweep(1));
            sweep(0);
        });
    });
}

/// One Qwen3-0.6B layer's matrices `(rows, cols)`: q, k and v share the 1024-column input, as
/// do gate and up; o reads 2048 columns, down 3072.
const QWEN3_LAYER: [(usize, usize); 7] =
    [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072)];

/// Deterministic BF16 weights of `layers` copies of [`QWEN3_LAYER`]'s matrices, in order.
fn qwen3_bf16_layers(layers: usize) -> Vec<Vec<u8>> {
    (0..layers).flat_map(|_| QWEN3_LAYER.iter().map(|(r, c)| weights(WeightDType::BF16, r * c))).collect()
}

/// The matrices of [`qwen3_bf16_layers`]' weights.
fn qwen3_bf16_matrices(datas: &[Vec<u8>]) -> Vec<WeightMatrix<'_>> {
    datas
        .iter()
        .zip(QWEN3_LAYER.iter().cycle())
        .map(|(data, (rows, cols))| WeightMatrix { dtype: WeightDType::BF16, rows: *rows, cols: *cols, data })
        .collect()
}

/// One decode token through all 28 layers of Qwen3-0.6B in BF16 on the `--precision f32` path
/// ([`kylin_kernels::matmul_many`], the GEMV), the matrices grouped as the engine groups them
/// (q/k/v, o, gate/up, down): 880 MB of weights, far beyond every cache, so each call streams
/// them from memory as a decode step does. Counted in bytes of weights read; compare with the
/// `head` shape of `gemv` (one 311 MB matrix, one long stream per thread).
#[divan::bench(sample_count = 30)]
fn model_bf16_decode(bencher: Bencher) {
    let pool = ThreadPool::new(threads());
    let datas = qwen3_bf16_layers(28);
    let matrices = qwen3_bf16_matrices(&datas);
    let bytes: usize = datas.iter().map(Vec::len).sum();
    decode_qwen3_layers(bencher, bytes, &matrices, &|x, jobs| kylin_kernels::matmul_many(&pool, x, 1, jobs));
}

/// [`model_bf16_decode`] with the weights in AVX2 strips ([`kylin_kernels::strips`]), as the
/// engine holds a model's float matrices on AVX2 without AVX-512.
#[divan::bench(sample_count = 30)]
fn model_strips_decode(bencher: Bencher) {
    use kylin_kernels::strips::{StripBuffer, matmul_many_strips};
    let pool = ThreadPool::new(threads());
    let strips: Vec<StripBuffer> = qwen3_bf16_matrices(&qwen3_bf16_layers(28))
        .into_iter()
        .map(|w| StripBuffer::pack(w).expect("a whole matrix"))
        .collect();
    let matrices: Vec<_> = strips.iter().map(StripBuffer::matrix).collect();
    let bytes: usize = strips.iter().map(StripBuffer::byte_len).sum();
    decode_qwen3_layers(bencher, bytes, &matrices, &|x, jobs| matmul_many_strips(&pool, x, 1, jobs));
}

/// A fused product `product(x, jobs)` over matrices of type `M`, each job a matrix and its output.
type Product<'a, M> = dyn Fn(&[f32], &mut [(M, &mut [f32])]) + 'a;

/// One decode token through the layers of `matrices` (Qwen3-0.6B's seven per layer), grouped
/// as the engine groups them (q/k/v, o, gate/up, down), by `product(x, jobs)`; counted in
/// `bytes` of weights.
fn decode_qwen3_layers<M: Copy>(bencher: Bencher, bytes: usize, matrices: &[M], product: &Product<M>) {
    let shapes = QWEN3_LAYER;
    let x: Vec<f32> = (0..3072).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let [mut q, mut k, mut v, mut o, mut gate, mut up, mut down] = shapes.map(|(rows, _)| vec![0.0f32; rows]);
    bencher.counter(BytesCount::new(bytes)).bench_local(|| {
        for w in matrices.chunks_exact(shapes.len()) {
            let x1024 = black_box(&x[..1024]);
            // (1, 1024) · (2048 | 1024 | 1024, 1024)ᵀ -> (1, 2048 | 1024 | 1024)
            product(x1024, &mut [(w[0], &mut q), (w[1], &mut k), (w[2], &mut v)]);
            // (1, 2048) · (1024, 2048)ᵀ -> (1, 1024)
            product(&x[..2048], &mut [(w[3], &mut o)]);
            // (1, 1024) · (3072, 1024)ᵀ -> (1, 3072), twice
            product(x1024, &mut [(w[4], &mut gate), (w[5], &mut up)]);
            // (1, 3072) · (1024, 3072)ᵀ -> (1, 1024)
            product(&x, &mut [(w[6], &mut down)]);
        }
    });
}

/// Batched decode through the engine's BF16 path ([`kylin_kernels::matmul_many_bf16`]) over
/// all 28 layers of Qwen3-0.6B (880 MB of weights, far beyond every cache, so each call streams
/// them from memory as a decode step does), for `TOKENS` tokens; counted in multiply-adds.
#[divan::bench(consts = [1, 2, 4, 8, 16])]
fn model_bf16_dot<const TOKENS: usize>(bencher: Bencher) {
    use kylin_kernels::{bf16_kernels, bf16_scratch_len, matmul_many_bf16};
    let Some(kernels) = bf16_kernels() else { return };
    const LAYERS: usize = 28;
    let pool = ThreadPool::new(threads());
    let shapes = QWEN3_LAYER;
    let datas = qwen3_bf16_layers(LAYERS);
    let matrices = qwen3_bf16_matrices(&datas);
    let x = vec![0.5f32; TOKENS * 3072];
    let [mut q, mut k, mut v, mut o, mut gate, mut up, mut down] = shapes.map(|(rows, _)| vec![0.0f32; TOKENS * rows]);
    let mut scratch = vec![0u16; bf16_scratch_len(TOKENS, 3072)];
    let macs: usize = LAYERS * shapes.iter().map(|(r, c)| r * c * TOKENS).sum::<usize>();
    bencher.counter(ItemsCount::new(macs)).bench_local(|| {
        for w in matrices.chunks_exact(shapes.len()) {
            let x1024 = black_box(&x[..TOKENS * 1024]);
            matmul_many_bf16(
                &pool,
                kernels,
                x1024,
                TOKENS,
                &mut scratch,
                &mut [(w[0], &mut q), (w[1], &mut k), (w[2], &mut v)],
            );
            matmul_many_bf16(&pool, kernels, &x[..TOKENS * 2048], TOKENS, &mut scratch, &mut [(w[3], &mut o)]);
            matmul_many_bf16(&pool, kernels, x1024, TOKENS, &mut scratch, &mut [(w[4], &mut gate), (w[5], &mut up)]);
            matmul_many_bf16(&pool, kernels, &x, TOKENS, &mut scratch, &mut [(w[6], &mut down)]);
        }
    });
}

/// The engine's BF16 path ([`kylin_kernels::matmul_many_bf16`]) on one 3072×1024 matrix (6 MB,
/// cache-resident after the first call), for `TOKENS` tokens: the kernel's compute rate.
#[divan::bench(consts = [8, 64, 512])]
fn gate_bf16_dot<const TOKENS: usize>(bencher: Bencher) {
    use kylin_kernels::{bf16_kernels, bf16_scratch_len, matmul_many_bf16};
    let Some(kernels) = bf16_kernels() else { return };
    let pool = ThreadPool::new(threads());
    let Gate { data, x, mut y } = Gate::new(TOKENS);
    let w = Gate::matrix(&data);
    let mut scratch = vec![0u16; bf16_scratch_len(TOKENS, Gate::COLS)];
    bencher
        .counter(ItemsCount::new(Gate::ROWS * Gate::COLS * TOKENS))
        .bench_local(|| matmul_many_bf16(&pool, kernels, black_box(&x), TOKENS, &mut scratch, &mut [(w, &mut y[..])]));
}

/// One decode token through one 256 × 1024 matrix quantized at load, 200 times over: the
/// planes (147 to 278 KB) stay in the second-level cache, so this measures how fast a format's
/// one-token tile computes when memory does not hold it back ([`model_quant_decode`] measures
/// it streaming from memory). Counted in bytes of the planes read.
#[divan::bench(args = ["q8_0", "q4_k", "q5_0", "q6_0", "q4_g_a16", "q8_0_a16", "f8_a16"], sample_count = 30)]
fn quant_decode_in_cache(bencher: Bencher, format: &str) {
    use kylin_kernels::quant::{Packing, quant_scratch_len};
    let pool = ThreadPool::new(threads());
    let packing = match format {
        "q8_0" => Packing::Q8_0,
        "q4_k" => Packing::Q4K,
        "q5_0" => Packing::Q5_0,
        "q4_g_a16" => Packing::Q4GA16,
        "q8_0_a16" => Packing::Q8_0A16,
        "f8_a16" => Packing::F8A16,
        _ => Packing::Q6_0,
    };
    let buffers = quantized_copies(packing, &[(256, 1024)], 1);
    let x: Vec<f32> = (0..1024).map(|i| ((i * 7919) % 2001) as f32 / 1000.0 - 1.0).collect();
    let mut scratch = vec![0u8; quant_scratch_len(1, 1024)];
    let mut y = vec![0.0f32; 256];
    const CALLS: usize = 200;
    let m = buffers[0].matrix();
    bencher.counter(BytesCount::new(CALLS * m.byte_len())).bench_local(|| {
        for _ in 0..CALLS {
            // (1, 1024) · (1024, 256)ᵀ -> (1, 256)
            m.matmul(&pool, black_box(&x[..m.cols()]), 1, &mut scratch, black_box(&mut y[..m.rows()]));
        }
    });
}
