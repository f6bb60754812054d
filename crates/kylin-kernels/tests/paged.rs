//! Paged attention against the scalar reference on contiguous keys and values: every KV element
//! type, odd head sizes, odd lengths, block sizes that do and do not divide the length, and
//! scattered block tables.

use kylin_kernels::WeightDType;
use kylin_kernels::paged::{KvView, MAX_QUERIES, PagedQuery, attention_paged, attention_paged_many, store_row};

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

/// Several query rows at once (a GQA group, consecutive tokens with growing lengths) give each
/// query the bits it gets alone: grouping is a speed choice, never a change of result.
#[test]
fn grouped_queries_have_the_bits_of_each_query_alone() {
    let (block_size, n_blocks) = (4usize, 40usize);
    for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
        for head_dim in [1, 7, 8, 31, 64, 100, 128] {
            let stride = block_size * head_dim;
            let size = dtype.size_in_bytes();
            let max_len: usize = 90;
            let mut keys = vec![0u8; n_blocks * stride * size];
            let mut vals = vec![0u8; n_blocks * stride * size];
            let blocks: Vec<u32> = (0..max_len.div_ceil(block_size)).map(|i| (n_blocks - 1 - i) as u32).collect();
            let k = values(max_len * head_dim, 11 + head_dim as u64);
            let v = values(max_len * head_dim, 12 + head_dim as u64);
            for p in 0..max_len {
                let at = blocks[p / block_size] as usize * stride + (p % block_size) * head_dim;
                store_row(dtype, &mut keys, at, &k[p * head_dim..(p + 1) * head_dim]);
                store_row(dtype, &mut vals, at, &v[p * head_dim..(p + 1) * head_dim]);
            }
            let view = |data| KvView { dtype, data, block_stride: stride, block_size, head_dim };
            let scale = (head_dim as f32).powf(-0.5);
            for nq in 1..=MAX_QUERIES {
                for lens in [[1usize, 1, 2, 2], [17, 17, 18, 18], [5, 40, 3, 89], [64, 65, 66, 67]] {
                    let qs: Vec<Vec<f32>> = (0..nq).map(|i| values(head_dim, 100 + i as u64)).collect();
                    // Alone.
                    let alone: Vec<Vec<u32>> = (0..nq)
                        .map(|i| {
                            let mut scores = vec![0.0; lens[i]];
                            let mut out = vec![0.0; head_dim];
                            attention_paged(
                                &qs[i],
                                view(&keys),
                                view(&vals),
                                &blocks,
                                0,
                                lens[i],
                                scale,
                                &mut scores,
                                &mut out,
                            );
                            out.iter().map(|x| x.to_bits()).collect()
                        })
                        .collect();
                    // Together.
                    let mut scores = vec![vec![0.0f32; max_len]; nq];
                    let mut outs = vec![vec![0.0f32; head_dim]; nq];
                    let mut queries: Vec<PagedQuery<'_>> = scores
                        .iter_mut()
                        .zip(outs.iter_mut())
                        .enumerate()
                        .map(|(i, (s, o))| PagedQuery { q: &qs[i], len: lens[i], scores: s, out: o })
                        .collect();
                    attention_paged_many(&mut queries, view(&keys), view(&vals), &blocks, 0, scale);
                    for i in 0..nq {
                        let got: Vec<u32> = outs[i].iter().map(|x| x.to_bits()).collect();
                        assert_eq!(got, alone[i], "{dtype:?} head_dim {head_dim} nq {nq} lens {lens:?} query {i}");
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
        for test in ["paged_attention_matches_the_reference", "grouped_queries_have_the_bits_of_each_query_alone"] {
            let status = std::process::Command::new(&exe)
                .args(["--exact", test])
                .env("KYLIN_KERNELS_ISA", cap)
                .status()
                .expect("spawn the test binary");
            assert!(status.success(), "{test} fails with KYLIN_KERNELS_ISA={cap}");
        }
    }
}
