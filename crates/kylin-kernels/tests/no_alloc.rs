//! The decode path allocates nothing: after the pool exists, `matmul` (GEMV and GEMM, with and
//! without the widened weight panel, for every dtype), `matmul_many` and every element-wise
//! kernel run without a single heap allocation on any thread. A counting global allocator
//! checks it; this file holds one test so nothing else allocates concurrently. The test re-runs
//! itself in a child process with `KYLIN_KERNELS_ISA=avx2` so the AVX2 GEMM is checked too.

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use std::sync::atomic::Ordering;

use counting_alloc::{ALLOCATIONS, Counting};
use kylin_kernels::{ThreadPool, WeightDType, WeightMatrix, WeightVector};

#[global_allocator]
static GLOBAL: Counting = Counting;

#[test]
fn kernels_do_not_allocate() {
    let pool = ThreadPool::new(2);
    let (rows, cols) = (512, 1024);
    let data = vec![0x3Fu8; rows * cols * 2];
    let w = WeightMatrix { dtype: WeightDType::BF16, rows, cols, data: &data };
    let norm = vec![0x3Fu8; cols * 2];
    let norm = WeightVector { dtype: WeightDType::BF16, data: &norm };
    let x = vec![0.5f32; 40 * cols];
    let mut y = vec![0.0f32; 40 * rows];
    let mut y2 = vec![0.0f32; 16 * rows];
    let mut scratch = vec![0.0f32; 64];
    let mut out = vec![0.0f32; 128];
    let mut normed = vec![0.0f32; cols];
    let cos = vec![0.5f32; 64];
    let sin = vec![0.5f32; 64];
    // Warm up: the ISA detection and the workers' first wake-up happen here.
    kylin_kernels::matmul(&pool, w, &x[..cols], 1, &mut y[..rows]);

    let f16 = WeightMatrix { dtype: WeightDType::F16, ..w };
    let f32_data = vec![0x3Fu8; rows * cols * 4];
    let f32w = WeightMatrix { dtype: WeightDType::F32, rows, cols, data: &f32_data };
    // Rows wider than the GEMM's f32 panel (2048 columns): the unpacked tile.
    let wide = WeightMatrix { dtype: WeightDType::BF16, rows: 16, cols: 4096, data: &data[..16 * 4096 * 2] };

    let before = ALLOCATIONS.load(Ordering::SeqCst);
    for _ in 0..10 {
        kylin_kernels::matmul(&pool, w, &x[..cols], 1, &mut y[..rows]);
        kylin_kernels::matmul(&pool, w, &x[..16 * cols], 16, &mut y[..16 * rows]);
        kylin_kernels::matmul(&pool, w, &x[..3 * cols], 3, &mut y[..3 * rows]);
        // 40 tokens: the GEMM widens each row tile into its f32 panel first.
        kylin_kernels::matmul(&pool, f16, &x, 40, &mut y);
        kylin_kernels::matmul(&pool, f32w, &x[..5 * cols], 5, &mut y[..5 * rows]);
        kylin_kernels::matmul(&pool, wide, &x[..9 * 4096], 9, &mut y[..9 * 16]);
        kylin_kernels::matmul_many(&pool, &x[..2 * cols], 2, &mut [(w, &mut y[..2 * rows]), (w, &mut y2[..2 * rows])]);
        let (first, second) =
            (kylin_kernels::FloatRowInput { matrix: w, row: 1 }, kylin_kernels::FloatRowInput { matrix: w, row: 0 });
        kylin_kernels::matmul_rows(&pool, &x[..2 * cols], &mut [(first, &mut y[..rows]), (second, &mut y2[..rows])]);
        kylin_kernels::rms_norm(&x[..cols], norm, 1e-6, &mut normed);
        kylin_kernels::rope_rotate_half(&mut out, &cos, &sin);
        kylin_kernels::attention_head(&x[..128], &x[..64 * 128], &x[..64 * 128], 64, 128, 0.1, &mut scratch, &mut out);
        kylin_kernels::softmax(&mut scratch);
        kylin_kernels::silu_mul(&mut normed, &x[..cols]);
        kylin_kernels::widen_row(w, 3, &mut normed);
    }
    let after = ALLOCATIONS.load(Ordering::SeqCst);
    assert_eq!(after - before, 0, "kernels allocated {} times", after - before);
    assert!(y.iter().all(|v| v.is_finite()));

    if std::env::var_os("KYLIN_KERNELS_ISA").is_none() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let status = std::process::Command::new(exe)
            .args(["--exact", "kernels_do_not_allocate"])
            .env("KYLIN_KERNELS_ISA", "avx2")
            .status()
            .expect("spawn the test binary");
        assert!(status.success(), "kernels allocate with KYLIN_KERNELS_ISA=avx2");
    }
}
