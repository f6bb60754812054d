//! Paged attention against the scalar reference on contiguous keys and values: every KV element
//! type, odd head sizes, odd lengths, block sizes that do and do not divide the length, and
//! scattered block tables.

use kylin_kernels::WeightDType;
use kylin_kernels::paged::{KvView, attention_paged, store_row};

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Rounds like the pool's storage does, so the reference sees the same numbers.
fn stored(dtype: WeightDType, x: f32) -> f32 {
    match dtype {
        WeightDType::F32 => x,
        WeightDType::F16 => half::f16::from_f32(x).to_f32(),
        WeightDType::BF16 => half::bf16::from_f32(x).to_f32(),
    }
}

#[test]
fn paged_attention_matches_the_reference() {
    let (n_layers, n_heads) = (2, 3);
    for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
        for head_dim in [1, 7, 8, 31, 64, 100] {
            for block_size in [1, 4, 16] {
                for len in [1usize, 5, 16, 17, 63] {
                    let n_blocks: usize = len.div_ceil(block_size) + 3;
                    let stride = n_layers * n_heads * block_size * head_dim;
                    let size = dtype.size_in_bytes();
                    let mut keys = vec![0u8; n_blocks * stride * size];
                    let mut vals = vec![0u8; n_blocks * stride * size];
                    // A scattered block table: blocks used in reverse order, skipping block 1.
                    let blocks: Vec<u32> = (0..len.div_ceil(block_size)).map(|i| (n_blocks - 1 - i) as u32).collect();
                    let (layer, head) = (1, 2);
                    let offset = (layer * n_heads + head) * block_size * head_dim;
                    let k = values(len * head_dim, 1 + len as u64);
                    let v = values(len * head_dim, 2 + head_dim as u64);
                    for p in 0..len {
                        let at = blocks[p / block_size] as usize * stride + offset + (p % block_size) * head_dim;
                        store_row(dtype, &mut keys, at, &k[p * head_dim..(p + 1) * head_dim]);
                        store_row(dtype, &mut vals, at, &v[p * head_dim..(p + 1) * head_dim]);
                    }
                    let q = values(head_dim, 3);
                    let scale = (head_dim as f32).powf(-0.5);
                    let view = |data| KvView { dtype, data, block_stride: stride, block_size, head_dim };
                    let mut scores = vec![0.0; len];
                    let mut out = vec![0.0; head_dim];
                    attention_paged(&q, view(&keys), view(&vals), &blocks, offset, len, scale, &mut scores, &mut out);

                    let kr: Vec<f32> = k.iter().map(|&x| stored(dtype, x)).collect();
                    let vr: Vec<f32> = v.iter().map(|&x| stored(dtype, x)).collect();
                    let mut ref_scores = vec![0.0; len];
                    let mut want = vec![0.0; head_dim];
                    kylin_kernels::reference::attention_head(
                        &q,
                        &kr,
                        &vr,
                        len,
                        head_dim,
                        scale,
                        &mut ref_scores,
                        &mut want,
                    );
                    for (c, (a, b)) in out.iter().zip(&want).enumerate() {
                        assert!(
                            (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                            "{dtype:?} head_dim {head_dim} block {block_size} len {len} col {c}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "outside the KV pool")]
fn a_block_outside_the_pool_panics_instead_of_reading() {
    let data = vec![0u8; 4 * 8 * 4];
    let view = KvView { dtype: WeightDType::F32, data: &data, block_stride: 8, block_size: 2, head_dim: 4 };
    let mut scores = [0.0; 2];
    let mut out = [0.0; 4];
    attention_paged(&[0.0; 4], view, view, &[9], 0, 2, 1.0, &mut scores, &mut out);
}

/// Re-runs the reference comparison in a child process under every instruction set this
/// machine can be capped to, so the AVX2 and scalar paths are checked as well as the default.
#[test]
fn every_isa_matches_the_reference() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        // Already a child (or the caller chose one ISA): the test above covers it.
        return;
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx2", "scalar"] {
        let status = std::process::Command::new(&exe)
            .args(["--exact", "paged_attention_matches_the_reference"])
            .env("KYLIN_KERNELS_ISA", cap)
            .status()
            .expect("spawn the test binary");
        assert!(status.success(), "paged attention differs from the reference with KYLIN_KERNELS_ISA={cap}");
    }
}
