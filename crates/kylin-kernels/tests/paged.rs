//! Blocked paged attention against the scalar reference on contiguous keys and values: every KV
//! element type, odd head sizes, odd lengths (across tiles and partitions), block sizes that do
//! and do not divide the length or sixteen, and scattered block tables; sliding windows
//! (`QueryRow::from`) and soft-capped scores; every row's bits independent of the rows it is
//! computed with and of split-K; and the blocks a window has left behind never read.

use kylin_kernels::paged::{
    AttentionNeeds, AttentionPath, KvLayout, KvView, MAX_ROWS, PARTITION, PartialStats, QueryRow, ScoreMap, TILE,
    attention_paged, attention_path, attention_rows, attention_rows_partition, merge_partitions, store_key, store_row,
    store_value,
};
use kylin_kernels::{Precision, WeightDType};

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

/// A pool of two layers and three KV heads whose (layer 1, head 2) holds `k` and `v` for
/// positions `0..len`, in blocks used in reverse order (skipping block 1); the other heads and
/// every unused slot hold large values, so reading one by mistake shows. Stored in the layout
/// of the path `precision` takes for layers with `needs`.
struct Pool {
    layout: KvLayout,
    keys: Vec<u8>,
    vals: Vec<u8>,
    blocks: Vec<u32>,
    offset: usize,
    stride: usize,
}

#[allow(clippy::too_many_arguments)]
fn pool(
    precision: Precision,
    dtype: WeightDType,
    head_dim: usize,
    block_size: usize,
    k: &[f32],
    v: &[f32],
    len: usize,
    needs: AttentionNeeds,
) -> Pool {
    let layout = attention_path(precision, dtype, head_dim, block_size, needs).layout();
    let (n_layers, n_heads) = (2, 3);
    let n_blocks = len.div_ceil(block_size) + 3;
    let stride = n_layers * n_heads * block_size * head_dim;
    let size = dtype.size_in_bytes();
    let mut keys = vec![0u8; n_blocks * stride * size];
    let mut vals = vec![0u8; n_blocks * stride * size];
    store_row(dtype, &mut keys, 0, &vec![1.0e4; n_blocks * stride]);
    store_row(dtype, &mut vals, 0, &vec![-1.0e4; n_blocks * stride]);
    let blocks: Vec<u32> = (0..len.div_ceil(block_size)).map(|i| (n_blocks - 1 - i) as u32).collect();
    let offset = (n_heads + 2) * block_size * head_dim;
    for p in 0..len {
        let tile = blocks[p / block_size] as usize * stride + offset;
        let slot = p % block_size;
        store_key(layout, dtype, &mut keys, tile, block_size, slot, &k[p * head_dim..(p + 1) * head_dim]);
        store_value(layout, dtype, &mut vals, tile, block_size, slot, &v[p * head_dim..(p + 1) * head_dim]);
    }
    Pool { layout, keys, vals, blocks, offset, stride }
}

impl Pool {
    fn views(&self, dtype: WeightDType, block_size: usize, head_dim: usize) -> (KvView<'_>, KvView<'_>) {
        let layout = self.layout;
        let view = |data| KvView { dtype, layout, data, block_stride: self.stride, block_size, head_dim };
        (view(&self.keys), view(&self.vals))
    }
}

/// Both precisions against the f32 reference: f32 to 2e-5; BF16 (whose AMX path rounds q, k,
/// v and the softmax weights to BF16, 8 significant bits) to 2e-2.
#[test]
fn paged_attention_matches_the_reference() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for head_dim in [1, 7, 16, 31, 64, 100, 128] {
                for block_size in [1, 5, 16, 32] {
                    let tolerance = match attention_path(precision, dtype, head_dim, block_size, AttentionNeeds::NONE) {
                        AttentionPath::F32 => 2e-5,
                        AttentionPath::AmxBf16 | AttentionPath::Avx512Bf16 => 2e-2,
                    };
                    for len in [1usize, 5, 16, 17, 33, 63, 64, 65, PARTITION + 37] {
                        let k = values(len * head_dim, 1 + len as u64);
                        let v = values(len * head_dim, 2 + head_dim as u64);
                        let pool = pool(precision, dtype, head_dim, block_size, &k, &v, len, AttentionNeeds::NONE);
                        let (keys, vals) = pool.views(dtype, block_size, head_dim);
                        // Queries large enough that the scores spread (an online softmax that
                        // rescales wrongly shows).
                        let q: Vec<f32> = values(head_dim, 3).iter().map(|x| x * 4.0).collect();
                        let scale = (head_dim as f32).powf(-0.5);
                        let mut out = vec![0.0; head_dim];
                        let map = ScoreMap::scaled(scale);
                        attention_paged(&q, keys, vals, &pool.blocks, pool.offset, len, map, &mut out);

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
                                (a - b).abs() <= tolerance * (1.0 + b.abs()),
                                "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} len {len} col {c}: {a} vs {b}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Many query rows at once (the query heads of a GQA group, consecutive tokens of a prompt,
/// rows of unequal lengths) give each row the bits it gets alone: how rows are grouped (a
/// prefill chunk, a decode step, another chunking) never changes a result.
#[test]
fn rows_have_the_bits_of_each_row_alone() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for (head_dim, block_size) in [(1, 4), (7, 16), (64, 16), (100, 3), (96, 48), (128, 16), (128, 32)] {
                let max_len: usize = PARTITION + 90;
                let k = values(max_len * head_dim, 11 + head_dim as u64);
                let v = values(max_len * head_dim, 12 + head_dim as u64);
                let pool = pool(precision, dtype, head_dim, block_size, &k, &v, max_len, AttentionNeeds::NONE);
                let (keys, vals) = pool.views(dtype, block_size, head_dim);
                let scale = (head_dim as f32).powf(-0.5);
                let qs: Vec<Vec<f32>> = (0..MAX_ROWS).map(|i| values(head_dim, 100 + i as u64)).collect();
                // Row lengths: a prefill chunk (two heads per token, growing positions) crossing a
                // tile and a partition boundary, a decode group (equal lengths), and a mix.
                let prefill: Vec<usize> = (0..MAX_ROWS).map(|i| PARTITION - 20 + i / 2).collect();
                let decode: Vec<usize> = vec![max_len; MAX_ROWS];
                let mixed: Vec<usize> = (0..MAX_ROWS).map(|i| 1 + (i * 37) % max_len).collect();
                for lens in [prefill, decode, mixed] {
                    let alone: Vec<Vec<u32>> = (0..MAX_ROWS)
                        .map(|i| {
                            let mut out = vec![0.0; head_dim];
                            let map = ScoreMap::scaled(scale);
                            attention_paged(&qs[i], keys, vals, &pool.blocks, pool.offset, lens[i], map, &mut out);
                            out.iter().map(|x| x.to_bits()).collect()
                        })
                        .collect();
                    for n in [2, 3, 5, 12, 13, 25, MAX_ROWS] {
                        for first in [0, MAX_ROWS - n] {
                            let mut outs = vec![vec![0.0f32; head_dim]; n];
                            let mut rows: Vec<QueryRow<'_>> = outs
                                .iter_mut()
                                .enumerate()
                                .map(|(i, out)| QueryRow { q: &qs[first + i], from: 0, len: lens[first + i], out })
                                .collect();
                            attention_rows(&mut rows, keys, vals, &pool.blocks, pool.offset, ScoreMap::scaled(scale));
                            for (i, out) in outs.iter().enumerate() {
                                let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                                assert_eq!(
                                    got,
                                    alone[first + i],
                                    "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} rows {n} from {first}: row {i}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Split-K: the partitions of a long context computed by separate calls (one per thread in the
/// engine) and folded by `merge_partitions` give every row the bits of one call over the whole
/// context, on every path and element type; rows shorter than a partition's start get nothing
/// from it.
#[test]
fn split_partitions_merge_to_the_bits_of_one_call() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for (head_dim, block_size) in [(7, 16), (64, 16), (100, 3), (128, 32)] {
                let max_len = 3 * PARTITION + 77;
                let k = values(max_len * head_dim, 21 + head_dim as u64);
                let v = values(max_len * head_dim, 22 + head_dim as u64);
                let pool = pool(precision, dtype, head_dim, block_size, &k, &v, max_len, AttentionNeeds::NONE);
                let (keys, vals) = pool.views(dtype, block_size, head_dim);
                let scale = (head_dim as f32).powf(-0.5);
                // A decode group (equal lengths) and rows ending in different partitions.
                for lens in [vec![max_len; 3], vec![max_len, PARTITION, PARTITION + 1, 5, 2 * PARTITION + 3]] {
                    let n = lens.len();
                    let qs: Vec<Vec<f32>> = (0..n).map(|i| values(head_dim, 200 + i as u64)).collect();
                    let mut whole = vec![vec![0.0f32; head_dim]; n];
                    let mut rows: Vec<QueryRow<'_>> = whole
                        .iter_mut()
                        .enumerate()
                        .map(|(i, out)| QueryRow { q: &qs[i], from: 0, len: lens[i], out })
                        .collect();
                    attention_rows(&mut rows, keys, vals, &pool.blocks, pool.offset, ScoreMap::scaled(scale));

                    let parts = max_len.div_ceil(PARTITION);
                    let mut stats = vec![vec![PartialStats::EMPTY; n]; parts];
                    let mut partial = vec![vec![vec![0.0f32; head_dim]; n]; parts];
                    for p in 0..parts {
                        let mut rows: Vec<QueryRow<'_>> = partial[p]
                            .iter_mut()
                            .enumerate()
                            .map(|(i, out)| QueryRow { q: &qs[i], from: 0, len: lens[i], out })
                            .collect();
                        attention_rows_partition(
                            &mut rows,
                            keys,
                            vals,
                            &pool.blocks,
                            pool.offset,
                            ScoreMap::scaled(scale),
                            p,
                            &mut stats[p],
                        );
                    }
                    for i in 0..n {
                        // The partitions the row reaches, in order.
                        let reached = lens[i].div_ceil(PARTITION);
                        for p in reached..parts {
                            assert_eq!(stats[p][i], PartialStats::EMPTY);
                            assert!(partial[p][i].iter().all(|&x| x == 0.0));
                        }
                        let row_stats: Vec<PartialStats> = (0..reached).map(|p| stats[p][i]).collect();
                        let o: Vec<f32> = (0..reached).flat_map(|p| partial[p][i].clone()).collect();
                        let mut merged = vec![0.0f32; head_dim];
                        merge_partitions(keys.layout, &row_stats, &o, &mut merged);
                        let got: Vec<u32> = merged.iter().map(|x| x.to_bits()).collect();
                        let want: Vec<u32> = whole[i].iter().map(|x| x.to_bits()).collect();
                        assert_eq!(
                            got, want,
                            "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} lens {lens:?}: row {i}"
                        );
                    }
                }
            }
        }
    }
}

/// What the windowed and soft-capped tests ask of the path: both, so the pool is made in the
/// layout of a path that supports them (the AVX-512 BF16 path under `Precision::Bf16` where the
/// CPU has it; the f32 path where it has AMX, whose kernel supports neither).
const WINDOW_AND_CAP: AttentionNeeds = AttentionNeeds { window: true, softcap: true };

/// The tolerance against the reference of the path that reads a pool made for
/// [`WINDOW_AND_CAP`].
fn tolerance(precision: Precision, dtype: WeightDType, head_dim: usize, block_size: usize) -> f32 {
    match attention_path(precision, dtype, head_dim, block_size, WINDOW_AND_CAP) {
        AttentionPath::F32 => 2e-5,
        AttentionPath::AmxBf16 | AttentionPath::Avx512Bf16 => 2e-2,
    }
}

/// Window starts for a row of `len` positions: inside the first tile, on tile boundaries, just
/// before and after a partition boundary, inside a later partition, the last position, and
/// sliding windows (`from = len - W`, transformers' rule for the query at `len - 1`) shorter
/// and longer than the row.
fn froms(len: usize) -> Vec<usize> {
    let mut f = vec![0, 1, 15, 16, 17, 31, 32, 33, 100, PARTITION - 1, PARTITION, PARTITION + 1, PARTITION + 64];
    f.extend([1, 7, 32, 100, PARTITION, PARTITION + 40, 10 * PARTITION].map(|w: usize| len.saturating_sub(w)));
    f.push(len - 1);
    f.retain(|&from| from < len);
    f.sort_unstable();
    f.dedup();
    f
}

/// Rows attending to `from..len` (windows starting in the first tile, on tile boundaries, in a
/// later partition, or longer than the row), with and without a soft cap, on both precisions,
/// against the reference: the window and the cap are honoured on every path that takes them.
#[test]
fn windowed_and_soft_capped_rows_match_the_reference() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for (head_dim, block_size) in [(7, 5), (31, 16), (64, 16), (100, 3), (128, 32)] {
                let tolerance = tolerance(precision, dtype, head_dim, block_size);
                for len in [1usize, 33, 100, PARTITION + 37, 2 * PARTITION + 50] {
                    let k = values(len * head_dim, 31 + len as u64);
                    let v = values(len * head_dim, 32 + head_dim as u64);
                    let pool = pool(precision, dtype, head_dim, block_size, &k, &v, len, WINDOW_AND_CAP);
                    let (keys, vals) = pool.views(dtype, block_size, head_dim);
                    let kr: Vec<f32> = k.iter().map(|&x| stored(dtype, x)).collect();
                    let vr: Vec<f32> = v.iter().map(|&x| stored(dtype, x)).collect();
                    let q: Vec<f32> = values(head_dim, 33).iter().map(|x| x * 4.0).collect();
                    let scale = (head_dim as f32).powf(-0.5);
                    // Caps that saturate the scores (tanh's exponential branch), bend them, and
                    // barely touch them (its polynomial branch).
                    for softcap in [None, Some(0.5), Some(2.0), Some(30.0)] {
                        let map = ScoreMap { scale, softcap };
                        for from in froms(len) {
                            let mut out = vec![0.0; head_dim];
                            attention_rows(
                                &mut [QueryRow { q: &q, from, len, out: &mut out }],
                                keys,
                                vals,
                                &pool.blocks,
                                pool.offset,
                                map,
                            );
                            let mut want = vec![0.0; head_dim];
                            kylin_kernels::reference::attention_head_window(
                                &q, &kr, &vr, from, len, head_dim, scale, softcap, &mut want,
                            );
                            for (c, (a, b)) in out.iter().zip(&want).enumerate() {
                                assert!(
                                    (a - b).abs() <= tolerance * (1.0 + b.abs()),
                                    "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} len {len} \
                                     from {from} cap {softcap:?} col {c}: {a} vs {b}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Windowed and soft-capped rows computed together (a prefill chunk under a sliding window,
/// whose rows' windows start at consecutive positions; a decode group; a mix of windows) give
/// each row the bits it gets alone.
#[test]
fn windowed_rows_have_the_bits_of_each_row_alone() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for (head_dim, block_size) in [(1, 4), (7, 16), (64, 16), (100, 3), (128, 32)] {
                let max_len: usize = PARTITION + 90;
                let k = values(max_len * head_dim, 41 + head_dim as u64);
                let v = values(max_len * head_dim, 42 + head_dim as u64);
                let pool = pool(precision, dtype, head_dim, block_size, &k, &v, max_len, WINDOW_AND_CAP);
                let (keys, vals) = pool.views(dtype, block_size, head_dim);
                let scale = (head_dim as f32).powf(-0.5);
                let qs: Vec<Vec<f32>> = (0..MAX_ROWS).map(|i| values(head_dim, 300 + i as u64)).collect();
                // (from, len) per row: a prefill chunk (two heads per token) under windows of 40
                // and PARTITION - 3 positions whose starts cross tiles and the partition
                // boundary; a decode group under a window; a mix of windows and lengths.
                let prefill = |w: usize| -> Vec<(usize, usize)> {
                    (0..MAX_ROWS)
                        .map(|i| {
                            let len = PARTITION - 20 + i / 2;
                            (len.saturating_sub(w), len)
                        })
                        .collect()
                };
                let decode: Vec<(usize, usize)> = vec![(max_len - 77, max_len); MAX_ROWS];
                let mixed: Vec<(usize, usize)> = (0..MAX_ROWS)
                    .map(|i| {
                        let len = 1 + (i * 37) % max_len;
                        ((i * 53) % len, len)
                    })
                    .collect();
                for softcap in [None, Some(1.5)] {
                    let map = ScoreMap { scale, softcap };
                    for spans in [prefill(40), prefill(PARTITION - 3), decode.clone(), mixed.clone()] {
                        let alone: Vec<Vec<u32>> = (0..MAX_ROWS)
                            .map(|i| {
                                let mut out = vec![0.0; head_dim];
                                let (from, len) = spans[i];
                                let row = QueryRow { q: &qs[i], from, len, out: &mut out };
                                attention_rows(&mut [row], keys, vals, &pool.blocks, pool.offset, map);
                                out.iter().map(|x| x.to_bits()).collect()
                            })
                            .collect();
                        for n in [2, 3, 5, 12, 13, 25, MAX_ROWS] {
                            for first in [0, MAX_ROWS - n] {
                                let mut outs = vec![vec![0.0f32; head_dim]; n];
                                let mut rows: Vec<QueryRow<'_>> = outs
                                    .iter_mut()
                                    .enumerate()
                                    .map(|(i, out)| {
                                        let (from, len) = spans[first + i];
                                        QueryRow { q: &qs[first + i], from, len, out }
                                    })
                                    .collect();
                                attention_rows(&mut rows, keys, vals, &pool.blocks, pool.offset, map);
                                for (i, out) in outs.iter().enumerate() {
                                    let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                                    assert_eq!(
                                        got,
                                        alone[first + i],
                                        "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} cap \
                                         {softcap:?} rows {n} from {first}: row {i} {:?}",
                                        spans[first + i]
                                    );
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Split-K with windows: rows whose windows start in a later partition (or in the last one)
/// get `PartialStats::EMPTY` and zeros from the partitions before, and `merge_partitions` over
/// all the partitions (the empty ones skipped) gives the bits of one call, with and without a
/// soft cap.
#[test]
fn split_windowed_partitions_merge_to_the_bits_of_one_call() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for (head_dim, block_size) in [(7, 16), (64, 16), (100, 3), (128, 32)] {
                let max_len = 3 * PARTITION + 77;
                let k = values(max_len * head_dim, 51 + head_dim as u64);
                let v = values(max_len * head_dim, 52 + head_dim as u64);
                let pool = pool(precision, dtype, head_dim, block_size, &k, &v, max_len, WINDOW_AND_CAP);
                let (keys, vals) = pool.views(dtype, block_size, head_dim);
                let scale = (head_dim as f32).powf(-0.5);
                let spans = [
                    vec![(2 * PARTITION + 5, max_len); 3],
                    vec![
                        (2 * PARTITION + 5, max_len),
                        (PARTITION, max_len),
                        (PARTITION - 1, PARTITION + 1),
                        (0, 5),
                        (3 * PARTITION + 10, max_len),
                        (PARTITION + 2 * TILE, 2 * PARTITION + 3),
                        (max_len - 1, max_len),
                    ],
                ];
                for softcap in [None, Some(1.5)] {
                    let map = ScoreMap { scale, softcap };
                    for spans in &spans {
                        let n = spans.len();
                        let qs: Vec<Vec<f32>> = (0..n).map(|i| values(head_dim, 400 + i as u64)).collect();
                        let mut whole = vec![vec![0.0f32; head_dim]; n];
                        let mut rows: Vec<QueryRow<'_>> = whole
                            .iter_mut()
                            .enumerate()
                            .map(|(i, out)| QueryRow { q: &qs[i], from: spans[i].0, len: spans[i].1, out })
                            .collect();
                        attention_rows(&mut rows, keys, vals, &pool.blocks, pool.offset, map);

                        let parts = max_len.div_ceil(PARTITION);
                        let mut stats = vec![vec![PartialStats::EMPTY; n]; parts];
                        let mut partial = vec![vec![vec![0.0f32; head_dim]; n]; parts];
                        for p in 0..parts {
                            let mut rows: Vec<QueryRow<'_>> = partial[p]
                                .iter_mut()
                                .enumerate()
                                .map(|(i, out)| QueryRow { q: &qs[i], from: spans[i].0, len: spans[i].1, out })
                                .collect();
                            attention_rows_partition(
                                &mut rows,
                                keys,
                                vals,
                                &pool.blocks,
                                pool.offset,
                                map,
                                p,
                                &mut stats[p],
                            );
                        }
                        for i in 0..n {
                            let (from, len) = spans[i];
                            let reached = from / PARTITION..len.div_ceil(PARTITION);
                            for p in (0..parts).filter(|p| !reached.contains(p)) {
                                assert_eq!(stats[p][i], PartialStats::EMPTY, "row {i} partition {p}");
                                assert!(partial[p][i].iter().all(|&x| x == 0.0));
                            }
                            let row_stats: Vec<PartialStats> = (0..parts).map(|p| stats[p][i]).collect();
                            let o: Vec<f32> = (0..parts).flat_map(|p| partial[p][i].clone()).collect();
                            let mut merged = vec![0.0f32; head_dim];
                            merge_partitions(keys.layout, &row_stats, &o, &mut merged);
                            let got: Vec<u32> = merged.iter().map(|x| x.to_bits()).collect();
                            let want: Vec<u32> = whole[i].iter().map(|x| x.to_bits()).collect();
                            assert_eq!(
                                got, want,
                                "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} cap {softcap:?} \
                                 spans {spans:?}: row {i}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The blocks a sliding window has left behind are never read: with the table entries below
/// the rows' smallest `from / block_size` pointing far outside the pool and the blocks they
/// named filled with NaN, every row gets the bits it gets from the intact pool (one call and
/// split-K), and nothing panics.
#[test]
fn blocks_below_the_window_are_never_read() {
    for precision in [Precision::F32, Precision::Bf16] {
        for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
            for (head_dim, block_size) in [(7, 5), (64, 16), (100, 3), (128, 16), (128, 32)] {
                let len = 2 * PARTITION + 50;
                let k = values(len * head_dim, 61 + head_dim as u64);
                let v = values(len * head_dim, 62 + head_dim as u64);
                let clean = pool(precision, dtype, head_dim, block_size, &k, &v, len, WINDOW_AND_CAP);
                let scale = (head_dim as f32).powf(-0.5);
                let map = ScoreMap { scale, softcap: Some(3.0) };
                let qs: Vec<Vec<f32>> = (0..4).map(|i| values(head_dim, 500 + i as u64)).collect();
                for min_from in [17, 2 * TILE, PARTITION - 3, PARTITION + 40, len - 1] {
                    // The rows: one from `min_from`, the others from later.
                    let spans = [0, 1, 50, len].map(|d| ((min_from + d).min(len - 1), len));
                    let mut poisoned = Pool {
                        layout: clean.layout,
                        keys: clean.keys.clone(),
                        vals: clean.vals.clone(),
                        blocks: clean.blocks.clone(),
                        offset: clean.offset,
                        stride: clean.stride,
                    };
                    for (i, b) in poisoned.blocks[..min_from / block_size].iter_mut().enumerate() {
                        let at = *b as usize * clean.stride;
                        store_row(dtype, &mut poisoned.keys, at, &vec![f32::NAN; clean.stride]);
                        store_row(dtype, &mut poisoned.vals, at, &vec![f32::NAN; clean.stride]);
                        *b = u32::MAX - i as u32;
                    }
                    let run = |pool: &Pool, partition: Option<usize>| -> Vec<Vec<u32>> {
                        let (keys, vals) = pool.views(dtype, block_size, head_dim);
                        let mut outs = vec![vec![0.0f32; head_dim]; spans.len()];
                        let mut rows: Vec<QueryRow<'_>> = outs
                            .iter_mut()
                            .enumerate()
                            .map(|(i, out)| QueryRow { q: &qs[i], from: spans[i].0, len: spans[i].1, out })
                            .collect();
                        match partition {
                            None => attention_rows(&mut rows, keys, vals, &pool.blocks, pool.offset, map),
                            Some(p) => {
                                let mut stats = [PartialStats::EMPTY; 4];
                                attention_rows_partition(
                                    &mut rows,
                                    keys,
                                    vals,
                                    &pool.blocks,
                                    pool.offset,
                                    map,
                                    p,
                                    &mut stats,
                                );
                            }
                        }
                        outs.iter().map(|o| o.iter().map(|x| x.to_bits()).collect()).collect()
                    };
                    for partition in [None, Some(0), Some(1), Some(2)] {
                        let want = run(&clean, partition);
                        assert!(want.iter().flatten().all(|&x| !f32::from_bits(x).is_nan()));
                        assert_eq!(
                            run(&poisoned, partition),
                            want,
                            "{precision:?} {dtype:?} head_dim {head_dim} block {block_size} from {min_from} \
                             partition {partition:?}"
                        );
                    }
                }
            }
        }
    }
}

/// `attention_path` only gives a path that supports what the layers need.
#[test]
fn the_path_supports_the_needs_it_was_chosen_for() {
    for window in [false, true] {
        for softcap in [false, true] {
            let needs = AttentionNeeds { window, softcap };
            for precision in [Precision::F32, Precision::Bf16] {
                for dtype in [WeightDType::F32, WeightDType::F16, WeightDType::BF16] {
                    let path = attention_path(precision, dtype, 128, 32, needs);
                    assert!(path.supports(needs), "{precision:?} {dtype:?} {needs:?}: {path:?}");
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "from < len")]
fn a_window_past_the_row_panics() {
    let data = vec![0u8; 4 * 8 * 4];
    let view = KvView {
        dtype: WeightDType::F32,
        layout: KvLayout::Standard,
        data: &data,
        block_stride: 8,
        block_size: 2,
        head_dim: 4,
    };
    let mut out = [0.0; 4];
    let row = QueryRow { q: &[0.0; 4], from: 3, len: 3, out: &mut out };
    attention_rows(&mut [row], view, view, &[0, 1], 0, ScoreMap::scaled(1.0));
}

#[test]
#[should_panic(expected = "outside the KV pool")]
fn a_block_outside_the_pool_panics_instead_of_reading() {
    let data = vec![0u8; 4 * 8 * 4];
    let view = KvView {
        dtype: WeightDType::F32,
        layout: KvLayout::Standard,
        data: &data,
        block_stride: 8,
        block_size: 2,
        head_dim: 4,
    };
    let mut out = [0.0; 4];
    attention_paged(&[0.0; 4], view, view, &[9], 0, 2, ScoreMap::scaled(1.0), &mut out);
}

/// Every key and value element lands where its layout puts it, rounded as `half` rounds (ties
/// to even, NaN kept quiet, infinities and subnormals kept), and no other byte of the tile moves:
/// every element type and layout, even and odd slots, head sizes that do and do not fill a
/// vector, and the tile at an offset into the pool.
#[test]
fn stores_put_each_element_where_its_layout_says() {
    let specials = [
        f32::NAN,
        -f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::MAX,
        f32::MIN_POSITIVE / 3.0,
        -0.0,
        f32::from_bits(0x3F80_8000), // a tie that rounds down to even
        f32::from_bits(0x3F81_8000), // a tie that rounds up to even
        f32::from_bits(0x3F80_8001),
        f32::from_bits(0x7F7F_FFFF),
    ];
    let bits = |dtype: WeightDType, x: f32| -> u32 {
        match dtype {
            WeightDType::F32 => x.to_bits(),
            WeightDType::F16 => half::f16::from_f32(x).to_bits() as u32,
            WeightDType::BF16 => half::bf16::from_f32(x).to_bits() as u32,
        }
    };
    for dtype in [WeightDType::BF16, WeightDType::F16, WeightDType::F32] {
        let size = dtype.size_in_bytes();
        for layout in [KvLayout::Standard, KvLayout::Pairs] {
            for head_dim in [2, 6, 34, 64, 80, 128] {
                for block_size in [16, 32] {
                    let tile = 3 * block_size * head_dim;
                    let elements = tile + block_size * head_dim + 8;
                    for slot in [0, 1, 14, 15, block_size - 1] {
                        let mut src = values(head_dim, (head_dim * 31 + slot) as u64);
                        for (c, &x) in specials.iter().enumerate().take(head_dim) {
                            src[(c * 7 + slot) % head_dim] = x;
                        }
                        for store in ["key", "value"] {
                            let mut pool = vec![0xA5u8; elements * size];
                            if store == "key" {
                                store_key(layout, dtype, &mut pool, tile, block_size, slot, &src);
                            } else {
                                store_value(layout, dtype, &mut pool, tile, block_size, slot, &src);
                            }
                            let at = |c: usize| match (store, layout) {
                                ("key", KvLayout::Standard) => c * block_size + slot,
                                ("key", KvLayout::Pairs) => {
                                    ((slot / 16) * (head_dim / 2) + c / 2) * 32 + (slot % 16) * 2 + c % 2
                                }
                                (_, KvLayout::Standard) => slot * head_dim + c,
                                (_, KvLayout::Pairs) => (slot / 2) * head_dim * 2 + slot % 2 + 2 * c,
                            };
                            let mut expected = vec![0xA5u8; elements * size];
                            for (c, &x) in src.iter().enumerate() {
                                let e = (tile + at(c)) * size;
                                expected[e..e + size].copy_from_slice(&bits(dtype, x).to_le_bytes()[..size]);
                            }
                            assert!(
                                pool == expected,
                                "{store} {dtype:?} {layout:?} head_dim {head_dim} block {block_size} slot {slot}: first \
                                 wrong byte {:?}",
                                pool.iter().zip(&expected).position(|(a, b)| a != b)
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Re-runs the tests above in a child process under every instruction set this machine can be
/// capped to (`avx512` turns AMX off), so the AVX-512, AVX2 and scalar paths are checked as
/// well as the default.
#[test]
fn every_isa_matches_the_reference() {
    if std::env::var_os("KYLIN_KERNELS_ISA").is_some() {
        // Already a child (or the caller chose one ISA): the tests above cover it.
        return;
    }
    const TESTS: [&str; 8] = [
        "paged_attention_matches_the_reference",
        "stores_put_each_element_where_its_layout_says",
        "rows_have_the_bits_of_each_row_alone",
        "split_partitions_merge_to_the_bits_of_one_call",
        "windowed_and_soft_capped_rows_match_the_reference",
        "windowed_rows_have_the_bits_of_each_row_alone",
        "split_windowed_partitions_merge_to_the_bits_of_one_call",
        "blocks_below_the_window_are_never_read",
    ];
    let exe = std::env::current_exe().expect("the test binary's path");
    for cap in ["avx512", "avx2", "scalar"] {
        for test in TESTS {
            let status = std::process::Command::new(&exe)
                .args(["--exact", test])
                .env("KYLIN_KERNELS_ISA", cap)
                .status()
                .expect("spawn the test binary");
            assert!(status.success(), "{test} fails with KYLIN_KERNELS_ISA={cap}");
        }
    }
    // With the BF16 attention paths turned off (where the CPU has AMX or AVX-512 BF16, the default runs one).
    for test in TESTS {
        let status = std::process::Command::new(&exe)
            .args(["--exact", test])
            .env("KYLIN_BF16_ATTENTION", "0")
            .status()
            .expect("spawn the test binary");
        assert!(status.success(), "{test} fails with KYLIN_BF16_ATTENTION=0");
    }
}
