//! Blocked ("flash") attention over a paged KV cache: a sequence's keys and values live in
//! fixed-size blocks scattered through one pool, found through the sequence's block table, and
//! are read tile by tile with an online softmax, so no score row of the whole context is ever
//! materialised and each tile of keys and values is read once for many query rows.
//!
//! # Pool layout ([`KvView`])
//!
//! Block-major, then layer, then KV head: the `block_size × head_dim` elements of one
//! (block, layer, head) are contiguous. Inside that tile, **keys are stored transposed**,
//! `(head_dim, block_size)` (element `(c, slot)` at `c · block_size + slot`), so sixteen
//! consecutive positions of one key dimension are one vector; **values are stored by row**,
//! `(block_size, head_dim)`. Element type F32, F16 or BF16 ([`WeightDType`]); everything is
//! widened to f32 in registers and accumulated in f32. This is [`KvLayout::Standard`]; the BF16
//! paths read a BF16 cache in [`KvLayout::Pairs`] instead (the operand layout of AMX's tiles and
//! of `vdpbf16ps`, see `paged_amx.rs` and `paged_dpbf16.rs`). [`attention_path`] picks the
//! path and with it the layout, once, when the pool is made; write keys with [`store_key`] and
//! values with [`store_value`].
//!
//! # The canonical computation (what batch invariance rests on)
//!
//! Every query row, whatever it is computed with (alone in a decode step, among 47 others of a
//! prefill chunk, in any chunking of its prompt), goes through exactly these floating-point
//! operations, so its output has the same bits (DESIGN.md invariant 7):
//!
//! 1. Its positions `from..len` ([`QueryRow`]: `from` is where a sliding window starts, 0
//!    without one) are cut at absolute multiples of [`PARTITION`] into partitions, and each
//!    partition at absolute multiples of [`TILE`] into tiles. A partition or a tile that holds
//!    no position of the row is skipped for it (no state update, no fold), so a window changes
//!    neither where the cuts are nor the operations on the positions it keeps.
//! 2. Per partition a fresh state `(m = -inf, l = 0, o = 0)`; per tile, in order:
//!    - scores `s_j = (Σ_c q_c · k_jc) · scale` (one fused multiply-add per dimension `c` in
//!      order, from zero; then the scale); with a soft cap ([`ScoreMap::softcap`]),
//!      `s_j = cap · tanh(s_j / cap)` (a tanh made of the kernel's own lane operations, see
//!      [`ScoreMap`]); then positions outside `from..len` set to `-inf`;
//!    - `m' = max(m, max_j s_j)`, `corr = e^(m - m')`, `p_j = e^(s_j - m')` (0 outside
//!      `from..len`);
//!    - `l = fma(l, corr, sum(p))` (the sum in a fixed tree: the tile's two halves added lane by
//!      lane, then the eight-lane tree of `hsum`);
//!    - `o = o · corr`, then `o = fma(p_j, v_j, o)` for each position `j` of `from..len` in the
//!      tile, in order.
//! 3. Partitions fold in order into `(M, L, O)`: `M' = max(M, m)`, `a = e^(M - M')`,
//!    `b = e^(m - M')`, `L = fma(l, b, L · a)`, `O = fma(o, b, O · a)`.
//! 4. `out = O · (1 / L)`.
//!
//! The exponential is [`crate::x86`]'s `exp8` on x86 (`f32::exp` in the portable path); the
//! partitions exist so that a long context can be split across threads (each partition
//! computed on its own, then folded in the same order by [`merge_partitions`]) without changing
//! a bit.
//!
//! # Sliding windows read only the window
//!
//! A call reads keys and values from the tile (and partition) holding the smallest `from` of
//! its rows (`min_from`) on: no entry of the block table below `min_from / block_size` is
//! checked, addressed or read, so the engine may free (and reuse) the blocks a sliding window
//! has left behind, and leave stale ids in those entries of the block table.
//!
//! The f32 path and the AVX-512 BF16 path take windows and soft caps; the AMX path takes
//! neither (it cannot be tested without AMX hardware), so [`attention_path`] is told what the
//! layers need ([`AttentionNeeds`]) and falls back to the f32 path where AMX would run, and a
//! call that needs either on a pool the AMX path reads panics.
//!
//! Guarantees: nothing here allocates; every block id a call reads is checked against the pool
//! before any read, so a wrong block table panics instead of reading out of bounds.

// Register-blocked loops index several arrays by row on purpose (fixed trip counts the
// compiler unrolls into registers).
#![allow(clippy::needless_range_loop)]

use crate::{Bf16Kernels, Isa, Precision, WeightDType, bf16_kernels, isa};

#[cfg(target_arch = "x86_64")]
#[path = "paged_amx.rs"]
mod paged_amx;
#[cfg(target_arch = "x86_64")]
pub use paged_amx::AMX_TILE;
#[cfg(target_arch = "x86_64")]
#[path = "paged_dpbf16.rs"]
mod paged_dpbf16;

/// Positions per tile of the online softmax (absolute: tile `t` is `t·TILE .. (t+1)·TILE`).
pub const TILE: usize = 32;
/// Positions per partition (a multiple of [`TILE`]); see the module documentation.
pub const PARTITION: usize = 1024;
/// Most query rows one [`attention_rows`] call takes: each tile of keys and values is read
/// from memory once for all of them.
pub const MAX_ROWS: usize = 48;
/// Largest `head_dim` the kernels take (their per-row state lives on the stack): 512, Gemma
/// 4's global layers.
pub const MAX_HEAD_DIM: usize = 512;

/// Dtype codes used as const generic parameters (the same numbers as `x86`'s).
const DT_BF16: u8 = 0;
const DT_F16: u8 = 1;
const DT_F32: u8 = 2;

/// How a pool stores one (block, layer, KV head) tile of keys and of values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvLayout {
    /// Keys transposed, `(head_dim, block_size)`; values by row, `(block_size, head_dim)`. Read
    /// by the f32 path.
    Standard,
    /// AMX's pair layout (BF16 only): keys `(block_size / 16, head_dim / 2, 16, 2)`, values
    /// `(block_size / 2, head_dim, 2)`. Read by the AMX path.
    Pairs,
}

/// One pool of keys (or values) with its geometry.
#[derive(Debug, Clone, Copy)]
pub struct KvView<'a> {
    pub dtype: WeightDType,
    pub layout: KvLayout,
    /// The whole pool as little-endian bytes.
    pub data: &'a [u8],
    /// Elements per block (all layers and heads).
    pub block_stride: usize,
    /// Positions per block.
    pub block_size: usize,
    pub head_dim: usize,
}

impl KvView<'_> {
    /// Element offset of the (layer, head) tile holding position `p`, given the tile's offset
    /// inside a block.
    #[inline]
    fn tile_base(&self, blocks: &[u32], offset: usize, p: usize) -> usize {
        blocks[p / self.block_size] as usize * self.block_stride + offset
    }

    /// Panics unless positions `from..len` of the (layer, head) at `offset` are inside the pool
    /// (the entries of the table below `from / block_size` are not looked at).
    fn check(&self, blocks: &[u32], offset: usize, from: usize, len: usize) {
        let size = self.dtype.size_in_bytes();
        let elements = self.data.len() / size;
        assert!(offset + self.block_size * self.head_dim <= self.block_stride, "KV offset outside a block");
        assert!(blocks.len() * self.block_size >= len, "block table shorter than the sequence");
        for &b in &blocks[from / self.block_size..len.div_ceil(self.block_size)] {
            assert!((b as usize + 1) * self.block_stride <= elements, "block {b} outside the KV pool");
        }
    }
}

/// One query row of [`attention_rows`]: its vector `(head_dim)`, the positions it attends to
/// (`from..len`, `from < len`) and its output `(head_dim)`.
///
/// `from` is 0 for full attention; a sliding window of `W` positions for a query at position
/// `p` keeps the keys `k` with `p - k < W` (transformers' rule), i.e. `from = (p + 1)
/// .saturating_sub(W)` with `len = p + 1`. Blocks of the table wholly below `from` are never
/// read (see the module documentation).
pub struct QueryRow<'a> {
    pub q: &'a [f32],
    /// The first position the row attends to.
    pub from: usize,
    /// One past the last position the row attends to.
    pub len: usize,
    pub out: &'a mut [f32],
}

/// How a row's dot products `q · k` become attention scores, lane by lane, in this order:
/// `s = (q · k) · scale`, then with a soft cap `s = cap · tanh(s / cap)` (Gemma 2's
/// `attn_logit_softcapping`), then the mask of the row's positions.
///
/// The tanh is computed from the kernel's own lane operations (an odd polynomial below 0.625,
/// `1 - 2 / (e^(2|x|) + 1)` with the kernel's exponential above, `|x|` clamped at 10), to
/// within a few units in the last place of `f32::tanh`, and deterministic per lane, so a row's
/// bits never depend on the rows it is computed with.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreMap {
    /// The factor of every dot product (usually `head_dim^-0.5`).
    pub scale: f32,
    /// The soft cap `cap > 0`, if any.
    pub softcap: Option<f32>,
}

impl ScoreMap {
    /// Scores `(q · k) · scale`, not capped.
    pub const fn scaled(scale: f32) -> Self {
        ScoreMap { scale, softcap: None }
    }

    /// Whether the map can be applied (a finite scale, a finite positive cap).
    fn is_valid(&self) -> bool {
        self.scale.is_finite() && self.softcap.is_none_or(|c| c.is_finite() && c > 0.0)
    }
}

/// Attention of up to [`MAX_ROWS`] query rows over one KV head of one sequence:
/// `out_i = softmax(map(K[from_i..len_i] · q_i)) · V[from_i..len_i]`, computed tile by tile in
/// the canonical order of the module documentation (so each row's output has the same bits
/// whatever other rows share the call).
///
/// `blocks`: the sequence's block table (entries below the smallest `from / block_size` of
/// the rows are never read); `offset`: element offset of the (layer, KV head) tile inside a
/// block; `map`: the scale and soft cap of the scores. The cache's layout decides the path:
/// [`KvLayout::Pairs`] runs both products with BF16 inputs (on AMX, or on AVX-512 BF16 where
/// there is no AMX), [`KvLayout::Standard`] everything in f32. Panics if a row is malformed
/// (`from >= len`, short vectors), `head_dim > MAX_HEAD_DIM`, the map is not finite, a block
/// the rows read lies outside the pool, a pair-layout cache is not one [`attention_path`]
/// gives a BF16 path, or the rows need a window or a soft cap the cache's path does not
/// support ([`AttentionPath::supports`]).
pub fn attention_rows(
    rows: &mut [QueryRow<'_>],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    map: ScoreMap,
) {
    let stats = run(rows, keys, values, blocks, offset, map, None);
    for (r, st) in rows.iter_mut().zip(&stats) {
        let inv = 1.0 / st.l;
        for out in &mut r.out[..keys.head_dim] {
            *out *= inv;
        }
    }
}

/// [`attention_rows`] with an attention sink per row (gpt-oss's `sinks`, one logit per query
/// head): each row's softmax denominator gains `e^(sinks[i] - m_i)`, as if the sink were one
/// more score whose value vector is zero. The output is the plain one times
/// `l / (l + e^(sink - m))`, so split partitions merged by [`merge_partitions_sink`] give the
/// same bits.
#[allow(clippy::too_many_arguments)]
pub fn attention_rows_sinks(
    rows: &mut [QueryRow<'_>],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    map: ScoreMap,
    sinks: &[f32],
) {
    assert!(sinks.len() >= rows.len(), "one sink per row");
    let stats = run(rows, keys, values, blocks, offset, map, None);
    for ((r, st), &sink) in rows.iter_mut().zip(&stats).zip(sinks) {
        let inv = 1.0 / st.l;
        let out = &mut r.out[..keys.head_dim];
        for o in out.iter_mut() {
            *o *= inv;
        }
        apply_sink(out, *st, sink);
    }
}

/// Split-K: [`attention_rows`] over the positions of partition `partition` only
/// (`partition · PARTITION ..`), leaving each row's `out` undivided and its state in `stats`
/// (one per row). [`merge_partitions`] folds the partitions of a row, computed by as many
/// calls (on as many threads), into exactly the bits [`attention_rows`] gives. A row with no
/// position in the partition (shorter than its start, or whose window starts after its end)
/// gets `out = 0` and [`PartialStats::EMPTY`].
#[allow(clippy::too_many_arguments)]
pub fn attention_rows_partition(
    rows: &mut [QueryRow<'_>],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    map: ScoreMap,
    partition: usize,
    stats: &mut [PartialStats],
) {
    assert!(stats.len() >= rows.len(), "one PartialStats per row");
    let got = run(rows, keys, values, blocks, offset, map, Some(partition));
    stats[..rows.len()].copy_from_slice(&got[..rows.len()]);
}

/// Folds the partition states of one row, in order (`stats[p]` with its undivided output
/// `o[p · head_dim ..][..head_dim]`), and divides: `out` gets exactly the bits
/// [`attention_rows`] computes for the row in one call (the same fold, with the same
/// exponential as the path that reads a cache of `layout` on this CPU). A partition whose
/// state is [`PartialStats::EMPTY`] holds no position of the row and is skipped, as the
/// kernels skip it (so the partitions before a window's start may be passed or left out).
/// Panics if the lengths disagree.
pub fn merge_partitions(layout: KvLayout, stats: &[PartialStats], o: &[f32], out: &mut [f32]) {
    merge_folded(layout, stats, o, out);
}

/// [`merge_partitions`] for a row with an attention sink (gpt-oss): the softmax's denominator
/// gains `e^(sink - m)`, so the output has exactly the bits [`attention_rows_sinks`] gives the
/// row in one call.
pub fn merge_partitions_sink(layout: KvLayout, stats: &[PartialStats], o: &[f32], sink: f32, out: &mut [f32]) {
    let state = merge_folded(layout, stats, o, out);
    apply_sink(out, state, sink);
}

/// An attention sink on a row already divided by its state's `l`: the output times
/// `l / (l + e^(sink - m))`, as if the sink were one more score whose value vector is zero.
fn apply_sink(out: &mut [f32], state: PartialStats, sink: f32) {
    if state == PartialStats::EMPTY {
        return;
    }
    let factor = state.l / (state.l + (sink - state.m).exp());
    for o in out.iter_mut() {
        *o *= factor;
    }
}

/// The fold of [`merge_partitions`], returning the row's merged state.
fn merge_folded(layout: KvLayout, stats: &[PartialStats], o: &[f32], out: &mut [f32]) -> PartialStats {
    let hd = out.len();
    assert!(o.len() == stats.len() * hd, "one head_dim of output per partition");
    // SAFETY (each arm): the ISA was detected (the pair layout exists only with AMX, which
    // implies AVX-512).
    unsafe {
        match (layout, isa()) {
            #[cfg(target_arch = "x86_64")]
            (KvLayout::Pairs, _) | (KvLayout::Standard, Isa::Avx512) => simd::merge_avx512(stats, o, out),
            #[cfg(target_arch = "x86_64")]
            (KvLayout::Standard, Isa::Avx2Fma) => simd::merge_avx2(stats, o, out),
            _ => merge_body::<Portable>(stats, o, out),
        }
    }
}

/// The fold of [`merge_partitions`] for lanes `L` (the partition fold of the kernel bodies).
///
/// # Safety
/// `L`'s instructions are available.
#[inline(always)]
unsafe fn merge_body<L: Lanes>(stats: &[PartialStats], o: &[f32], out: &mut [f32]) -> PartialStats {
    let hd = out.len();
    let (mut big_m, mut big_l) = (f32::NEG_INFINITY, 0.0f32);
    out.fill(0.0);
    for (st, o) in stats.iter().zip(o.chunks_exact(hd)) {
        if *st == PartialStats::EMPTY {
            // No position of the row (folding it would make `e^(-inf - -inf)`).
            continue;
        }
        // SAFETY: scalar operations only, under the caller's features.
        unsafe {
            let big = big_m.max(st.m);
            let a = L::exp1(big_m - big);
            let b = L::exp1(st.m - big);
            big_l = L::fma1(st.l, b, big_l * a);
            fold_row::<L>(out, o, a, b);
            big_m = big;
        }
    }
    let inv = 1.0 / big_l;
    for out in out.iter_mut() {
        *out *= inv;
    }
    PartialStats { m: big_m, l: big_l }
}

/// One partition's output folded into a row's: `out = fma(o, b, out · a)` element-wise, sixteen
/// lanes at a time and then one element at a time; every element is the same two IEEE
/// operations either way (the partition folds of [`merge_partitions`] and of the BF16 paths).
///
/// # Safety
/// `L`'s instructions are available.
#[inline(always)]
unsafe fn fold_row<L: Lanes>(out: &mut [f32], o: &[f32], a: f32, b: f32) {
    let hd = out.len();
    assert!(o.len() >= hd, "a partition output shorter than the row");
    // SAFETY: `c + 16 <= hd <= o.len()` for the lane loads and stores; the caller's features.
    unsafe {
        let (av, bv) = (L::splat(a), L::splat(b));
        let (out_p, o_p) = (out.as_mut_ptr(), o.as_ptr());
        let mut c = 0;
        while c + 16 <= hd {
            L::fma(L::load_f32(o_p.add(c)), bv, L::mul(L::load_f32(out_p.add(c)), av)).store_f32(out_p.add(c));
            c += 16;
        }
        for c in c..hd {
            *out_p.add(c) = L::fma1(*o_p.add(c), b, *out_p.add(c) * a);
        }
    }
}

/// The checked entry of [`attention_rows`] and [`attention_rows_partition`]: runs the path of
/// the cache's layout and returns each row's state, its `out` undivided.
#[allow(clippy::too_many_arguments)]
fn run(
    rows: &mut [QueryRow<'_>],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    map: ScoreMap,
    partition: Option<usize>,
) -> Stats {
    let hd = keys.head_dim;
    assert!(rows.len() <= MAX_ROWS, "at most {MAX_ROWS} rows per call");
    assert!(hd <= MAX_HEAD_DIM, "head_dim {hd} above {MAX_HEAD_DIM}");
    assert!(
        values.head_dim == hd
            && values.block_size == keys.block_size
            && values.dtype == keys.dtype
            && values.layout == keys.layout
    );
    assert!(map.is_valid(), "attention scores need a finite scale and a finite positive soft cap: {map:?}");
    let empty = [PartialStats::EMPTY; MAX_ROWS];
    let Some(max_len) = rows.iter().map(|r| r.len).max() else { return empty };
    let mut min_from = max_len;
    for r in rows.iter() {
        assert!(
            r.from < r.len && r.q.len() >= hd && r.out.len() >= hd,
            "a query row needs from < len and head_dim elements"
        );
        min_from = min_from.min(r.from);
    }
    keys.check(blocks, offset, min_from, max_len);
    values.check(blocks, offset, min_from, max_len);
    let job = Job { keys, values, blocks, offset, map, min_from, partition };
    let (first, end) = job.span(max_len);
    if first.max(min_from) >= end {
        // No row has a position in the partition.
        for r in rows.iter_mut() {
            r.out[..hd].fill(0.0);
        }
        return empty;
    }
    if keys.layout == KvLayout::Pairs {
        let path = attention_path(Precision::Bf16, keys.dtype, hd, keys.block_size, AttentionNeeds::NONE);
        assert!(path.layout() == KvLayout::Pairs, "a pair-layout KV cache needs a BF16 attention path");
        let needs = AttentionNeeds { window: min_from > 0, softcap: map.softcap.is_some() };
        assert!(
            path.supports(needs),
            "the {} attention path does not support {needs:?}: make the pool with attention_path(.., needs)",
            path.name()
        );
        // SAFETY: the path's instructions were detected and permitted (`bf16_kernels`: AMX or
        // AVX-512 BF16, both implying AVX-512); the cache is BF16 with head and block sizes the
        // path takes (`attention_path`); the path supports the rows' windows and soft cap (the
        // AMX path gets neither); the checks above passed.
        #[cfg(target_arch = "x86_64")]
        return unsafe {
            match path {
                AttentionPath::Avx512Bf16 => paged_dpbf16::rows_dpbf16(rows, &job),
                _ if keys.block_size.is_multiple_of(32) => paged_amx::rows_amx::<true>(rows, &job),
                _ => paged_amx::rows_amx::<false>(rows, &job),
            }
        };
    }
    // SAFETY (each arm): the ISA was detected; every position of `min_from..max_len` lies in a
    // block of the table inside the pool (checked), every row holds `head_dim` elements.
    unsafe {
        match (isa(), keys.dtype) {
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, WeightDType::BF16) => simd::rows_avx512::<DT_BF16>(rows, &job),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, WeightDType::F16) => simd::rows_avx512::<DT_F16>(rows, &job),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx512, WeightDType::F32) => simd::rows_avx512::<DT_F32>(rows, &job),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2Fma, WeightDType::BF16) => simd::rows_avx2::<DT_BF16>(rows, &job),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2Fma, WeightDType::F16) => simd::rows_avx2::<DT_F16>(rows, &job),
            #[cfg(target_arch = "x86_64")]
            (Isa::Avx2Fma, WeightDType::F32) => simd::rows_avx2::<DT_F32>(rows, &job),
            (_, WeightDType::BF16) => rows_body::<Portable, DT_BF16>(rows, &job),
            (_, WeightDType::F16) => rows_body::<Portable, DT_F16>(rows, &job),
            (_, WeightDType::F32) => rows_body::<Portable, DT_F32>(rows, &job),
        }
    }
}

/// [`attention_rows`] for one query row over positions `0..len`.
#[allow(clippy::too_many_arguments)]
pub fn attention_paged(
    q: &[f32],
    keys: KvView<'_>,
    values: KvView<'_>,
    blocks: &[u32],
    offset: usize,
    len: usize,
    map: ScoreMap,
    out: &mut [f32],
) {
    attention_rows(&mut [QueryRow { q, from: 0, len, out }], keys, values, blocks, offset, map);
}

/// Which arithmetic attention uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionPath {
    /// f32 products on the SIMD lanes of this CPU (or the portable code).
    F32,
    /// BF16 inputs, f32 accumulation, on AMX tiles.
    AmxBf16,
    /// BF16 inputs, f32 accumulation, on AVX-512 BF16 dot products (`vdpbf16ps`), on CPUs
    /// without AMX.
    Avx512Bf16,
}

impl AttentionPath {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            AttentionPath::F32 => "f32",
            AttentionPath::AmxBf16 => "amx-bf16",
            AttentionPath::Avx512Bf16 => "avx512-bf16",
        }
    }
}

impl AttentionPath {
    /// The layout of the KV cache this path reads.
    pub fn layout(self) -> KvLayout {
        match self {
            AttentionPath::F32 => KvLayout::Standard,
            AttentionPath::AmxBf16 | AttentionPath::Avx512Bf16 => KvLayout::Pairs,
        }
    }

    /// Whether the path computes what a layer with these needs asks for: the f32 and AVX-512
    /// BF16 paths everything, the AMX path neither windows nor soft caps (its kernel is not
    /// extended: it cannot be tested without AMX hardware).
    pub fn supports(self, needs: AttentionNeeds) -> bool {
        match self {
            AttentionPath::F32 | AttentionPath::Avx512Bf16 => true,
            AttentionPath::AmxBf16 => needs == AttentionNeeds::NONE,
        }
    }
}

/// What the attention layers a KV pool serves ask of the kernels, beyond plain causal attention
/// (for [`attention_path`], which then picks a path that supports it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AttentionNeeds {
    /// Some layer attends through a sliding window (rows with `from > 0`).
    pub window: bool,
    /// Some layer soft-caps its scores ([`ScoreMap::softcap`]).
    pub softcap: bool,
}

impl AttentionNeeds {
    /// Plain causal attention: every row from position 0, scores not capped.
    pub const NONE: AttentionNeeds = AttentionNeeds { window: false, softcap: false };
}

/// Whether the BF16 attention paths (AMX, AVX-512 BF16) may be used: on by default;
/// `KYLIN_BF16_ATTENTION=0` (or its older name `KYLIN_AMX_ATTENTION=0`) turns them off, for
/// comparisons with the f32 path.
fn bf16_attention_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    crate::env_switch(&ON, &["KYLIN_BF16_ATTENTION", "KYLIN_AMX_ATTENTION"])
}

/// The path attention takes for this precision, cache element type, head size and block size
/// on this CPU, for layers with `needs`: under `--precision bf16` over a BF16 cache, with a
/// head size that is a multiple of 32 and a block size that is a multiple of 16, the BF16
/// kernels' family (AMX tiles, or `vdpbf16ps` where there is no AMX) if it supports `needs`
/// ([`AttentionPath::supports`]: AMX with a window or a soft cap falls back); f32 otherwise. A
/// pool is made in [`AttentionPath::layout`] of the path it will be read by, with the needs of
/// every layer it serves.
pub fn attention_path(
    precision: Precision,
    dtype: WeightDType,
    head_dim: usize,
    block_size: usize,
    needs: AttentionNeeds,
) -> AttentionPath {
    let shapes = head_dim.is_multiple_of(32) && block_size.is_multiple_of(16);
    if !cfg!(target_arch = "x86_64")
        || precision != Precision::Bf16
        || dtype != WeightDType::BF16
        || !shapes
        || !bf16_attention_enabled()
    {
        return AttentionPath::F32;
    }
    let path = match bf16_kernels() {
        Some(Bf16Kernels::Amx) => AttentionPath::AmxBf16,
        Some(Bf16Kernels::Avx512Bf16) => AttentionPath::Avx512Bf16,
        None => AttentionPath::F32,
    };
    if path.supports(needs) { path } else { AttentionPath::F32 }
}

/// What every row of one call shares.
struct Job<'a> {
    keys: KvView<'a>,
    values: KvView<'a>,
    blocks: &'a [u32],
    offset: usize,
    map: ScoreMap,
    /// The smallest `from` of the rows: no position below it is read.
    min_from: usize,
    /// Only this partition (split-K), or all of them.
    partition: Option<usize>,
}

impl Job<'_> {
    /// The (layer, head) tiles of keys and values of every block that starts in positions
    /// `from..to` (clipped to `max_len`), for [`rows_body`] to ask the second-level cache for
    /// one tile ahead: a sequence's blocks lie far apart in the pool (a block holds every layer
    /// and head), so without it each block's tile starts on cold misses the hardware
    /// prefetcher only catches up with part-way, and decode's attention, a few query rows per
    /// tile, waits on memory. [`micro`] spreads the prefetches over its score loop
    /// ([`NextTile`]), and so does the AVX-512 BF16 path's in decode (`paged_dpbf16`); asked
    /// for in one burst they gained nothing there (BENCHMARKS.md, issue 36). A prefetch is a
    /// hint: it reads nothing and changes no result.
    #[inline(always)]
    fn next_tile(&self, from: usize, to: usize, max_len: usize) -> NextTile {
        let (bs, size) = (self.keys.block_size, self.keys.dtype.size_in_bytes());
        let mut next = NextTile { lines: (bs * self.keys.head_dim * size).div_ceil(64), ..NextTile::none() };
        let mut p = from.div_ceil(bs) * bs;
        while p < to.min(max_len) && next.views + 2 <= NEXT_TILE_VIEWS {
            // `p < max_len`, so its block is in the table (checked by `run`).
            for view in [&self.keys, &self.values] {
                let at = view.tile_base(self.blocks, self.offset, p) * size;
                next.starts[next.views] = view.data.as_ptr().wrapping_add(at);
                next.views += 1;
            }
            p += bs;
        }
        next
    }

    /// The positions `first..end` the call covers for rows of at most `max_len` positions:
    /// `first` is the start of the first partition it computes (a multiple of [`PARTITION`],
    /// that of `min_from` when it computes them all), which may lie below `min_from`.
    fn span(&self, max_len: usize) -> (usize, usize) {
        match self.partition {
            None => (self.min_from / PARTITION * PARTITION, max_len),
            Some(p) => {
                (p.saturating_mul(PARTITION).min(max_len), p.saturating_add(1).saturating_mul(PARTITION).min(max_len))
            }
        }
    }
}

/// The running maximum and sum of one row's online softmax after the partitions a call covered
/// (its output, before the division by `l`, is the row's `out`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartialStats {
    pub m: f32,
    pub l: f32,
}

impl PartialStats {
    /// The state before any partition.
    pub const EMPTY: PartialStats = PartialStats { m: f32::NEG_INFINITY, l: 0.0 };
}

/// What the kernel bodies return: each row's state, its `out` left undivided.
type Stats = [PartialStats; MAX_ROWS];

/// Sixteen f32 lanes, the unit of the kernel: one per ISA. Every method is a plain lane-wise
/// IEEE operation (or the documented reduction), so the generic body below performs the same
/// operations whatever implementation runs it.
trait Lanes: Copy {
    /// Rows one register-blocked micro-kernel takes.
    const MICRO_ROWS: usize;
    /// Rows up to which a micro-kernel keeps two vectors of accumulators per row in registers:
    /// both 16-position halves of a tile's scores in one pass over the key columns, and 32
    /// value columns per pass. Above it (AVX2's sixteen registers with more than three rows),
    /// each half is scored in its own pass and values go 16 columns per pass, so that twice the
    /// rows share each key and value load. Each score and output element takes the same
    /// operations in the same order either way, so the choice changes no bit.
    const PAIRED_ROWS: usize;
    /// Whether [`weighted`] may keep up to 16 vectors of accumulators in registers (passes of
    /// 64 and 128 columns for few rows).
    const WIDE_PASSES: bool;
    /// Whether decode's micro-kernels (at most [`TILE_VALUES_MAX_ROWS`] rows) ask for their
    /// tile's value rows while they compute its scores ([`TileValues`]), instead of the next
    /// tile's blocks ([`NextTile`]): for AVX2, whose narrow passes read each value row in
    /// several strided visits.
    const PREFETCH_VALUES: bool;
    /// Runs [`micro`] for `count` rows (`1..=MICRO_ROWS`), each implementation instantiating
    /// only the row counts it uses.
    #[allow(clippy::too_many_arguments)]
    unsafe fn micro_rows<const D: u8>(
        count: usize,
        rows: &[QueryRow<'_>],
        first: usize,
        st: &mut RowState,
        halves: &[KeyHalf; 2],
        n_halves: usize,
        vrows: &[*const u8; TILE],
        map: ScoreMap,
        hd: usize,
    );
    unsafe fn zero() -> Self;
    unsafe fn splat(x: f32) -> Self;
    /// Sixteen elements of dtype `D` from element `i` of `p`, widened.
    unsafe fn load<const D: u8>(p: *const u8, i: usize) -> Self;
    unsafe fn load_f32(p: *const f32) -> Self;
    unsafe fn store_f32(self, p: *mut f32);
    /// `a · b + c`, fused.
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self;
    unsafe fn mul(a: Self, b: Self) -> Self;
    unsafe fn add(a: Self, b: Self) -> Self;
    unsafe fn sub(a: Self, b: Self) -> Self;
    unsafe fn max(a: Self, b: Self) -> Self;
    unsafe fn min(a: Self, b: Self) -> Self;
    unsafe fn div(a: Self, b: Self) -> Self;
    /// `|self|`.
    unsafe fn abs(self) -> Self;
    /// The magnitude of `self` with the sign of `sign`.
    unsafe fn copy_sign(self, sign: Self) -> Self;
    /// `a` in the lanes where `x < limit`, `b` in the others (NaN included).
    unsafe fn select_below(x: Self, limit: f32, a: Self, b: Self) -> Self;
    /// Lanes outside `lo..hi` replaced by `fill`.
    unsafe fn keep(self, lo: usize, hi: usize, fill: f32) -> Self;
    unsafe fn exp(self) -> Self;
    unsafe fn exp1(x: f32) -> f32;
    /// Largest lane.
    unsafe fn reduce_max(self) -> f32;
    /// `hsum(lo8 + hi8)`, with `x86::hsum`'s tree.
    unsafe fn reduce_add(self) -> f32;
    /// One element of dtype `D`, widened.
    unsafe fn load1<const D: u8>(p: *const u8, i: usize) -> f32;
    /// `a · b + c`, fused, on one element.
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32;
}

/// `tanh` lane by lane, from the operations of `L` (so the same operations on every lane, and
/// bit for bit the same result for a lane whatever the other lanes hold): Cephes' `tanhf`, an
/// odd polynomial for `|x| < 0.625` and `1 - 2 / (e^(2|x|) + 1)` with `L`'s exponential above
/// (`|x|` clamped at 10, where the result is 1 within an ulp; no overflow, no NaN from a finite
/// input), the sign of `x` restored. Within a few ulps of `f32::tanh`.
///
/// # Safety
/// `L`'s instructions are available.
#[inline(always)]
unsafe fn tanh_lanes<L: Lanes>(x: L) -> L {
    // SAFETY: lane-wise operations only, under the caller's features.
    unsafe {
        let ax = x.abs();
        let z = L::mul(x, x);
        let mut poly = L::splat(-5.704_988_7e-3);
        for c in [2.063_909e-2, -5.373_971_6e-2, 1.333_144_2e-1, -3.333_328e-1] {
            poly = L::fma(poly, z, L::splat(c));
        }
        let small = L::fma(L::mul(poly, z), x, x);
        let e = L::mul(L::min(ax, L::splat(10.0)), L::splat(2.0)).exp();
        let large = L::sub(L::splat(1.0), L::div(L::splat(2.0), L::add(e, L::splat(1.0))));
        L::select_below(ax, 0.625, small, large).copy_sign(x)
    }
}

/// `cap · tanh(s / cap)` lane by lane: [`ScoreMap`]'s soft cap.
///
/// # Safety
/// `L`'s instructions are available.
#[inline(always)]
unsafe fn softcap_lanes<L: Lanes>(s: L, cap: f32) -> L {
    // SAFETY: lane-wise operations only, under the caller's features.
    unsafe {
        let c = L::splat(cap);
        L::mul(c, tanh_lanes(L::div(s, c)))
    }
}

/// Block tiles (keys and values) whose starts [`NextTile`] holds: the blocks starting in the
/// next tile's positions, two views each (the f32 path's 32 positions in blocks of 16, Kylin's
/// default, make 4; the AVX-512 BF16 path's 128 make 16).
const NEXT_TILE_VIEWS: usize = 16;

/// The cache lines of the next tile's blocks ([`Job::next_tile`]) that the current tile asks
/// the second-level cache for while it computes its scores, a few per column, instead of all
/// at once before it. Asked for in one burst (256 lines for Qwen3's 128-dimension heads in
/// blocks of 16 positions of f16, 16 KiB), the prefetches waited for free miss buffers and
/// held the tile's own loads behind them: in decode after 512 tokens, a fifth of the kernel's
/// samples fell on two `prefetcht1` instructions. Spread, one decode step's attention over an
/// f16 cache (`paged_attention_model`, medians of three alternating runs) went from 12.9–13.4
/// to 9.5–10.2 ms for Qwen3-0.6B's 28 layers at a 2k context, and from 33.7–35.3 to
/// 22.3–23.8 ms for Gemma 3 1B's at 16k (BENCHMARKS.md). Block tiles beyond
/// [`NEXT_TILE_VIEWS`] (blocks of fewer than 8 positions) are not prefetched.
struct NextTile {
    /// Where each block tile starts.
    starts: [*const u8; NEXT_TILE_VIEWS],
    /// Block tiles in `starts`.
    views: usize,
    /// Cache lines per block tile.
    lines: usize,
    /// The next line to ask for: block tile `view`, line `line`.
    view: usize,
    line: usize,
}

impl NextTile {
    /// Nothing to ask for.
    fn none() -> NextTile {
        NextTile { starts: [std::ptr::null(); NEXT_TILE_VIEWS], views: 0, lines: 0, view: 0, line: 0 }
    }

    /// Lines still to ask for.
    fn remaining(&self) -> usize {
        if self.view >= self.views { 0 } else { (self.views - self.view) * self.lines - self.line }
    }

    /// Asks for up to `n` more lines.
    #[inline(always)]
    fn step(&mut self, n: usize) {
        for _ in 0..n {
            if self.view >= self.views {
                return;
            }
            #[cfg(target_arch = "x86_64")]
            crate::prefetch_lines(self.starts[self.view].wrapping_add(64 * self.line), 1);
            self.line += 1;
            if self.line == self.lines {
                self.line = 0;
                self.view += 1;
            }
        }
    }
}

/// The cache lines of the current tile's value rows, which decode's micro-kernel (at most
/// [`TILE_VALUES_MAX_ROWS`] rows, so one per tile) asks the second-level cache for while it
/// computes the tile's scores, a few per key column, so that the value passes that follow find
/// them in cache; the next tile's blocks ([`NextTile`]) are then not asked for, and the
/// hardware prefetchers follow the keys.
///
/// Why, on AVX2 ([`Lanes::PREFETCH_VALUES`]): [`weighted`] reads each value row in several
/// passes of 32 columns, each visiting all the tile's 32 rows (512 bytes apart in f32), a
/// strided pattern the hardware prefetchers do not follow; a third of the kernel's samples in
/// decode on a Zen 3 were those loads waiting for memory. Asking for the next tile's blocks
/// instead (as AVX-512 does) did not help them, and in f32 it cost more than it gave: the
/// prefetches themselves stalled on full miss buffers. One decode step's attention over
/// Qwen3-0.6B's cache at a 2k context (`paged_attention_model`, two threads) went from about
/// 23 to 28 GB/s in f32, 22 to 26 in f16 and 13 to 17 for Gemma 3 1B's 4 rows at 16k
/// (BENCHMARKS.md); the bits do not change.
struct TileValues<'a> {
    /// The tile's value rows (null where a position is no row's).
    rows: &'a [*const u8; TILE],
    /// Cache lines per value row.
    row_lines: usize,
    /// The next line to ask for: line `line` of row `row`.
    row: usize,
    line: usize,
}

impl<'a> TileValues<'a> {
    /// The lines of `rows`, each `bytes` long; none when `ask` is false.
    fn new(rows: &'a [*const u8; TILE], bytes: usize, ask: bool) -> TileValues<'a> {
        TileValues { rows, row_lines: bytes.div_ceil(64), row: if ask { 0 } else { TILE }, line: 0 }
    }

    /// Lines still to ask for.
    fn remaining(&self) -> usize {
        if self.row >= TILE { 0 } else { (TILE - self.row) * self.row_lines - self.line }
    }

    /// Asks for up to `n` more lines.
    #[inline(always)]
    fn step(&mut self, n: usize) {
        for _ in 0..n {
            if self.row >= TILE {
                return;
            }
            let row = self.rows[self.row];
            if !row.is_null() {
                #[cfg(target_arch = "x86_64")]
                crate::prefetch_lines(row.wrapping_add(64 * self.line), 1);
            }
            self.line += 1;
            if self.line == self.row_lines {
                self.line = 0;
                self.row += 1;
            }
        }
    }
}

/// Most rows of a call whose micro-kernel asks for its tile's values ([`TileValues`]): decode's
/// query heads per KV head in Qwen3 (2), Llama 3 and Gemma 3 (4). The micro-kernels of more
/// rows do not carry the code (in Gemma 4's 6-row kernel, its register pressure made the 8-row
/// decode 12% slower).
const TILE_VALUES_MAX_ROWS: usize = 4;

/// Per-row state of one call, on the stack.
struct RowState {
    /// Running partition fold: `M`, `L`.
    big_m: [f32; MAX_ROWS],
    big_l: [f32; MAX_ROWS],
    /// Current partition: `m`, `l`, and the tile's rescale factor.
    m: [f32; MAX_ROWS],
    l: [f32; MAX_ROWS],
    corr: [f32; MAX_ROWS],
    /// Positions `lo..hi` of the current tile (counted from its start) each row uses; none
    /// when `lo >= hi`.
    lo: [usize; MAX_ROWS],
    hi: [usize; MAX_ROWS],
    /// Current partition's `o`, `(MAX_ROWS, MAX_HEAD_DIM)` row-major, of which rows `< n` and
    /// columns `< head_dim` are initialised (written before they are read).
    o: *mut f32,
    /// The tile's `p`, `(MAX_ROWS, TILE)`.
    p: [[f32; TILE]; MAX_ROWS],
    /// The next tile's blocks, asked for during this tile's scores.
    next: NextTile,
    /// Whether the call's one micro-kernel asks for each tile's value rows ([`TileValues`])
    /// instead of the next tile's blocks.
    ask_values: bool,
}

/// Where one 16-position half of a key tile is read: a pointer to element `(0, first)` and the
/// element stride between dimensions.
#[derive(Clone, Copy)]
struct KeyHalf {
    ptr: *const u8,
    stride: usize,
}

/// The body of [`attention_rows`] for lanes `L` and dtype `D`.
///
/// # Safety
/// `L`'s instructions are available; the checks of [`attention_rows`] passed.
#[inline(always)]
unsafe fn rows_body<L: Lanes, const D: u8>(rows: &mut [QueryRow<'_>], job: &Job<'_>) -> Stats {
    let n = rows.len();
    let hd = job.keys.head_dim;
    let bs = job.keys.block_size;
    let size = job.keys.dtype.size_in_bytes();
    let max_len = rows.iter().map(|r| r.len).max().unwrap_or(0);
    // Only the part of `o` a call uses is written (zeroed per partition), never all 48 KiB.
    let mut o_rows = std::mem::MaybeUninit::<[[f32; MAX_HEAD_DIM]; MAX_ROWS]>::uninit();
    let mut st = RowState {
        big_m: [f32::NEG_INFINITY; MAX_ROWS],
        big_l: [0.0; MAX_ROWS],
        m: [0.0; MAX_ROWS],
        l: [0.0; MAX_ROWS],
        corr: [0.0; MAX_ROWS],
        lo: [0; MAX_ROWS],
        hi: [0; MAX_ROWS],
        o: o_rows.as_mut_ptr() as *mut f32,
        p: [[0.0; TILE]; MAX_ROWS],
        next: NextTile::none(),
        ask_values: L::PREFETCH_VALUES && n <= TILE_VALUES_MAX_ROWS,
    };
    // Transposed copies of key halves when the block size is not a multiple of 16 (so sixteen
    // positions are not contiguous): `(head_dim, 16)` each, in the pool's dtype; every byte
    // read is written first.
    let mut pack = std::mem::MaybeUninit::<[[u8; MAX_HEAD_DIM * 16 * 4]; 2]>::uninit();
    let pack = pack.as_mut_ptr() as *mut u8;
    let direct = bs.is_multiple_of(16);
    let min_from = job.min_from;
    for r in rows.iter_mut() {
        r.out[..hd].fill(0.0);
    }
    let (mut part0, end) = job.span(max_len);
    while part0 < end {
        let part_end = (part0 + PARTITION).min(max_len);
        for i in 0..n {
            st.m[i] = f32::NEG_INFINITY;
            st.l[i] = 0.0;
            // SAFETY: row `i < n <= MAX_ROWS` of `o` has `MAX_HEAD_DIM >= hd` elements.
            unsafe { std::ptr::write_bytes(st.o.add(i * MAX_HEAD_DIM), 0, hd) };
        }
        // The tiles from the one holding `min_from` (the tiles before hold no row's position).
        let mut t0 = part0.max(min_from / TILE * TILE);
        while t0 < part_end {
            let tile_len = TILE.min(part_end - t0);
            for (i, r) in rows.iter().enumerate() {
                st.lo[i] = r.from.saturating_sub(t0).min(TILE);
                st.hi[i] = r.len.saturating_sub(t0).min(TILE);
            }
            // Key halves of this tile (positions t0..t0 + 16 and t0 + 16..t0 + 32). A half
            // wholly below `min_from` is no row's: it is not read (its scores are masked), and
            // its pointer is the other half's (below).
            let mut halves = [KeyHalf { ptr: std::ptr::null(), stride: 16 }; 2];
            let n_halves = tile_len.div_ceil(16);
            let below = t0 + 16 <= min_from;
            debug_assert!(!below || n_halves == 2, "a tile holds a position of min_from..part_end");
            for (h, half) in halves.iter_mut().enumerate().take(n_halves).skip(below as usize) {
                let first = t0 + 16 * h;
                // SAFETY: `first < max_len` and `first + 16 > min_from`, so the block of
                // `first` is one of the blocks from `min_from`'s on, in the table and inside the
                // pool (checked); with `direct`, the sixteen positions from `first` are in that
                // block; `pack_keys` reads only positions of `min_from..max_len`.
                unsafe {
                    if direct {
                        let at = job.keys.tile_base(job.blocks, job.offset, first) + first % bs;
                        *half = KeyHalf { ptr: job.keys.data.as_ptr().add(at * size), stride: bs };
                    } else {
                        let dst = pack.add(h * MAX_HEAD_DIM * 16 * 4);
                        pack_keys(&job.keys, job.blocks, job.offset, first, min_from, max_len, dst);
                        *half = KeyHalf { ptr: dst, stride: 16 };
                    }
                }
            }
            if n_halves == 1 {
                halves[1] = halves[0];
            } else if below {
                // Some position of the tile is at or above `min_from`, so the second half is.
                halves[0] = halves[1];
            }
            // Value rows of this tile, from `min_from` on (the rows below are no row's), one
            // block at a time (rows `hd` elements apart inside a block).
            let mut vrows = [std::ptr::null::<u8>(); TILE];
            let mut j = min_from.saturating_sub(t0);
            while j < tile_len {
                let p = t0 + j;
                let slot = p % bs;
                let run = (bs - slot).min(tile_len - j);
                let at = job.values.tile_base(job.blocks, job.offset, p) + slot * hd;
                for (k, v) in vrows[j..j + run].iter_mut().enumerate() {
                    // SAFETY: positions `p..p + run` of `min_from..max_len` lie in the block of
                    // `p`, in the table and inside the pool (checked).
                    *v = unsafe { job.values.data.as_ptr().add((at + k * hd) * size) };
                }
                j += run;
            }
            st.next = if st.ask_values { NextTile::none() } else { job.next_tile(t0 + TILE, t0 + 2 * TILE, max_len) };
            if n > L::MICRO_ROWS {
                // Many rows (prefill): several micro-kernels run over this tile, long enough
                // to hide one burst, as before; spreading is for decode's few rows.
                st.next.step(usize::MAX);
            }
            // Micro-kernels over the rows that use this tile.
            let mut first = 0;
            while first < n {
                let count = L::MICRO_ROWS.min(n - first);
                // SAFETY: the caller's contract; rows `first..first + count` exist.
                unsafe {
                    L::micro_rows::<D>(count, rows, first, &mut st, &halves, n_halves, &vrows, job.map, hd);
                }
                first += count;
            }
            t0 += TILE;
        }
        // Fold the partition into the running state of each row with a position in it.
        for (i, r) in rows.iter_mut().enumerate() {
            if r.len <= part0 || r.from >= part_end {
                continue;
            }
            // SAFETY: scalar operations only.
            unsafe {
                let big = st.big_m[i].max(st.m[i]);
                let a = L::exp1(st.big_m[i] - big);
                let b = L::exp1(st.m[i] - big);
                st.big_l[i] = L::fma1(st.l[i], b, st.big_l[i] * a);
                let o = st.o.add(i * MAX_HEAD_DIM);
                for (c, out) in r.out[..hd].iter_mut().enumerate() {
                    *out = L::fma1(*o.add(c), b, *out * a);
                }
                st.big_m[i] = big;
            }
        }
        part0 = part_end;
    }
    std::array::from_fn(|i| PartialStats { m: st.big_m[i], l: st.big_l[i] })
}

/// Copies key positions `first..first + 16` (those of `from..max_len`; zeros for the others,
/// which are not read) of one (layer, head) into `pack` as `(head_dim, 16)`.
///
/// # Safety
/// Positions of `from..max_len` lie in blocks of the table inside the pool; `pack` is valid
/// for `head_dim * 16` elements.
#[allow(clippy::too_many_arguments)]
unsafe fn pack_keys(
    keys: &KvView<'_>,
    blocks: &[u32],
    offset: usize,
    first: usize,
    from: usize,
    max_len: usize,
    pack: *mut u8,
) {
    let (hd, bs, size) = (keys.head_dim, keys.block_size, keys.dtype.size_in_bytes());
    for k in 0..16 {
        let p = first + k;
        for c in 0..hd {
            // SAFETY: the caller's contract.
            let dst = unsafe { pack.add((c * 16 + k) * size) };
            if (from..max_len).contains(&p) {
                let at = (keys.tile_base(blocks, offset, p) + c * bs + p % bs) * size;
                let src = &keys.data[at..at + size];
                // SAFETY: `dst` holds `size` bytes (the caller's contract).
                unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst, size) };
            } else {
                // SAFETY: as above.
                unsafe { std::ptr::write_bytes(dst, 0, size) };
            }
        }
    }
}

/// The body of [`Lanes::micro_rows`]: a match over the row counts `1..=MICRO_ROWS`.
macro_rules! micro_rows_body {
    ($($k:literal)*) => {
        #[inline(always)]
        unsafe fn micro_rows<const D: u8>(
            count: usize,
            rows: &[$crate::paged::QueryRow<'_>],
            first: usize,
            st: &mut $crate::paged::RowState,
            halves: &[$crate::paged::KeyHalf; 2],
            n_halves: usize,
            vrows: &[*const u8; $crate::paged::TILE],
            map: $crate::paged::ScoreMap,
            hd: usize,
        ) {
            match count {
                // SAFETY: the caller's contract.
                $($k => unsafe { $crate::paged::micro::<Self, D, $k>(rows, first, st, halves, n_halves, vrows, map, hd) },)*
                _ => unreachable!("a micro-kernel of {count} rows"),
            }
        }
    };
}

/// One tile for `NR` rows from row `first`: scores, the online-softmax update, and `o += p · V`.
///
/// # Safety
/// As [`rows_body`]; `NR` rows exist from `first`.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn micro<L: Lanes, const D: u8, const NR: usize>(
    rows: &[QueryRow<'_>],
    first: usize,
    st: &mut RowState,
    halves: &[KeyHalf; 2],
    n_halves: usize,
    vrows: &[*const u8; TILE],
    map: ScoreMap,
    hd: usize,
) {
    let lo: [usize; NR] = std::array::from_fn(|i| st.lo[first + i]);
    let hi: [usize; NR] = std::array::from_fn(|i| st.hi[first + i]);
    if (0..NR).all(|i| lo[i] >= hi[i]) {
        return;
    }
    let qs: [*const f32; NR] = std::array::from_fn(|i| rows[first + i].q.as_ptr());
    // SAFETY (whole body): key reads are dimensions `< hd` of halves inside the pool (or the
    // pack); value reads are rows `lo..hi` of `vrows` (positions of `min_from..max_len`) at
    // columns `< hd`; query reads are `< hd`; state indices are `< MAX_ROWS`, `< MAX_HEAD_DIM`,
    // `< TILE`.
    unsafe {
        // 1. Scores: s[i][h] = Σ_c q_i[c] · K[c][16h..16h + 16], in order of c.
        // The next tile's lines, a few per column (all of them over the first micro-kernel of
        // the tile's rows).
        let per_column = st.next.remaining().div_ceil(hd.max(1));
        // Or this tile's value lines, likewise (the call's only micro-kernel).
        let value_bytes = hd * if D == DT_F32 { 4 } else { 2 };
        let ask = NR <= TILE_VALUES_MAX_ROWS && st.ask_values;
        let mut values = TileValues::new(vrows, value_bytes, ask);
        let per_value = values.remaining().div_ceil(hd.max(1));
        let mut s = [[L::zero(); 2]; NR];
        let [k0, k1] = *halves;
        if NR > L::PAIRED_ROWS {
            // One pass per half (see `Lanes::PAIRED_ROWS`); a missing second half scores zero,
            // as below.
            for (h, half) in halves.iter().enumerate() {
                let mut sh = [L::zero(); NR];
                if h < n_halves {
                    for c in 0..hd {
                        st.next.step(per_column);
                        values.step(per_value);
                        let a = L::load::<D>(half.ptr, c * half.stride);
                        for i in 0..NR {
                            sh[i] = L::fma(L::splat(*qs[i].add(c)), a, sh[i]);
                        }
                    }
                }
                for i in 0..NR {
                    sh[i].store_f32(st.p[first + i].as_mut_ptr().add(16 * h));
                }
            }
        } else if n_halves == 2 {
            for c in 0..hd {
                st.next.step(per_column);
                values.step(per_value);
                let a = L::load::<D>(k0.ptr, c * k0.stride);
                let b = L::load::<D>(k1.ptr, c * k1.stride);
                for i in 0..NR {
                    let q = L::splat(*qs[i].add(c));
                    s[i][0] = L::fma(q, a, s[i][0]);
                    s[i][1] = L::fma(q, b, s[i][1]);
                }
            }
        } else {
            for c in 0..hd {
                st.next.step(per_column);
                values.step(per_value);
                let a = L::load::<D>(k0.ptr, c * k0.stride);
                for i in 0..NR {
                    s[i][0] = L::fma(L::splat(*qs[i].add(c)), a, s[i][0]);
                }
            }
        }
        // The raw scores go to each row's `p` (read back below): the accumulators stay in
        // registers through the loop above instead of being kept in memory as well.
        if NR <= L::PAIRED_ROWS {
            for i in 0..NR {
                let p = st.p[first + i].as_mut_ptr();
                s[i][0].store_f32(p);
                s[i][1].store_f32(p.add(16));
            }
        }
        // 2. Online softmax per row: scores mapped (scale, soft cap), masked to `lo..hi`.
        let sc = L::splat(map.scale);
        for i in 0..NR {
            let r = first + i;
            let (lo_a, hi_a) = (lo[i], hi[i]);
            if lo_a >= hi_a {
                continue;
            }
            let (lo_b, hi_b) = (lo_a.saturating_sub(16), hi_a.saturating_sub(16));
            let p = st.p[r].as_mut_ptr();
            let mut a = L::mul(L::load_f32(p), sc);
            let mut b = L::mul(L::load_f32(p.add(16)), sc);
            if let Some(cap) = map.softcap {
                a = softcap_lanes(a, cap);
                b = softcap_lanes(b, cap);
            }
            let a = a.keep(lo_a, hi_a, f32::NEG_INFINITY);
            let b = b.keep(lo_b, hi_b, f32::NEG_INFINITY);
            let m_new = st.m[r].max(L::max(a, b).reduce_max());
            let corr = L::exp1(st.m[r] - m_new);
            let mv = L::splat(m_new);
            let pa = L::exp(L::sub(a, mv)).keep(lo_a, hi_a, 0.0);
            let pb = L::exp(L::sub(b, mv)).keep(lo_b, hi_b, 0.0);
            st.l[r] = L::fma1(st.l[r], corr, L::add(pa, pb).reduce_add());
            st.m[r] = m_new;
            st.corr[r] = corr;
            pa.store_f32(p);
            pb.store_f32(p.add(16));
        }
        // 3. o = o · corr, then o += p_j · v_j for each position of `lo..hi` in order: for all
        // the rows at once when they use the same positions, else row by row.
        if (0..NR).all(|i| lo[i] == lo[0] && hi[i] == hi[0]) {
            let o: [*mut f32; NR] = std::array::from_fn(|i| st.o.add((first + i) * MAX_HEAD_DIM));
            let p: [*const f32; NR] = std::array::from_fn(|i| st.p[first + i].as_ptr());
            let corr: [f32; NR] = std::array::from_fn(|i| st.corr[first + i]);
            weighted::<L, D, NR>(o, p, corr, vrows, lo[0], hi[0], hd);
        } else {
            for i in 0..NR {
                let r = first + i;
                if lo[i] < hi[i] {
                    let p = st.p[r].as_ptr();
                    weighted::<L, D, 1>([st.o.add(r * MAX_HEAD_DIM)], [p], [st.corr[r]], vrows, lo[i], hi[i], hd);
                }
            }
        }
    }
}

/// `o_i = o_i · corr_i`, then `o_i = fma(p_i[j], v_j, o_i)` for `j in lo..hi`, for `NR` rows,
/// in passes over the columns (one at a time at the end). Each column's operations are the same
/// whatever the pass width, so the width changes no bit. With few rows and the registers for
/// it ([`Lanes::WIDE_PASSES`]) a pass covers 128 columns (`NR <= 2`) or 64 (`NR <= 4`), so that
/// each value row is read as one run of whole cache lines: decode's two query rows per KV head
/// otherwise read every value row four times, one cache line each, a strided pattern that left
/// the loads waiting on memory (a quarter of the kernel's samples on one load at a 2k context).
/// Otherwise 32 columns per pass, then 16 (16 only, above [`Lanes::PAIRED_ROWS`] rows).
///
/// # Safety
/// As [`micro`]; `o_i` hold `hd` elements, `p_i` `hi`, `vrows[lo..hi]` `hd` each.
#[inline(always)]
unsafe fn weighted<L: Lanes, const D: u8, const NR: usize>(
    o: [*mut f32; NR],
    p: [*const f32; NR],
    corr: [f32; NR],
    vrows: &[*const u8; TILE],
    lo: usize,
    hi: usize,
    hd: usize,
) {
    let hd16 = hd & !15;
    // Positions `lo..hi` only: `vrows[k]` and `p[i][k]` are position `lo + k` of the tile.
    let vrows = &vrows[lo..hi];
    // SAFETY: the caller's contract.
    unsafe {
        let p: [*const f32; NR] = std::array::from_fn(|i| p[i].add(lo));
        let cv: [L; NR] = std::array::from_fn(|i| L::splat(corr[i]));
        let mut c0 = 0;
        if L::WIDE_PASSES && NR <= 2 {
            while c0 + 128 <= hd16 {
                weighted_pass::<L, D, NR, 8>(o, p, cv, vrows, c0);
                c0 += 128;
            }
        }
        if L::WIDE_PASSES && NR <= 4 {
            while c0 + 64 <= hd16 {
                weighted_pass::<L, D, NR, 4>(o, p, cv, vrows, c0);
                c0 += 64;
            }
        }
        if NR <= L::PAIRED_ROWS {
            while c0 + 32 <= hd16 {
                weighted_pass::<L, D, NR, 2>(o, p, cv, vrows, c0);
                c0 += 32;
            }
        }
        while c0 < hd16 {
            weighted_pass::<L, D, NR, 1>(o, p, cv, vrows, c0);
            c0 += 16;
        }
        for c in hd16..hd {
            for i in 0..NR {
                let mut x = *o[i].add(c) * corr[i];
                for (j, &row) in vrows.iter().enumerate() {
                    x = L::fma1(*p[i].add(j), L::load1::<D>(row, c), x);
                }
                *o[i].add(c) = x;
            }
        }
    }
}

/// One pass of [`weighted`] over columns `c0..c0 + 16 · V` of `NR` rows: `V` vectors per row
/// held in registers across the positions.
///
/// # Safety
/// As [`weighted`]; `c0 + 16 · V <= hd`; `p_i` and `vrows` start at the pass's first position.
#[inline(always)]
unsafe fn weighted_pass<L: Lanes, const D: u8, const NR: usize, const V: usize>(
    o: [*mut f32; NR],
    p: [*const f32; NR],
    cv: [L; NR],
    vrows: &[*const u8],
    c0: usize,
) {
    // SAFETY: the caller's contract.
    unsafe {
        let mut acc: [[L; V]; NR] =
            std::array::from_fn(|i| std::array::from_fn(|v| L::mul(L::load_f32(o[i].add(c0 + 16 * v)), cv[i])));
        for (j, &row) in vrows.iter().enumerate() {
            let vals: [L; V] = std::array::from_fn(|v| L::load::<D>(row, c0 + 16 * v));
            for i in 0..NR {
                let pj = L::splat(*p[i].add(j));
                for v in 0..V {
                    acc[i][v] = L::fma(pj, vals[v], acc[i][v]);
                }
            }
        }
        for i in 0..NR {
            for v in 0..V {
                acc[i][v].store_f32(o[i].add(c0 + 16 * v));
            }
        }
    }
}

/// The portable implementation: sixteen scalars.
#[derive(Clone, Copy)]
struct Portable([f32; 16]);

impl Lanes for Portable {
    const MICRO_ROWS: usize = 4;
    const PAIRED_ROWS: usize = 4;
    const WIDE_PASSES: bool = false;
    const PREFETCH_VALUES: bool = false;
    micro_rows_body!(1 2 3 4);
    unsafe fn zero() -> Self {
        Portable([0.0; 16])
    }
    unsafe fn splat(x: f32) -> Self {
        Portable([x; 16])
    }
    unsafe fn load<const D: u8>(p: *const u8, i: usize) -> Self {
        // SAFETY: the caller's contract (elements `i..i + 16` readable).
        Portable(std::array::from_fn(|k| unsafe { Self::load1::<D>(p, i + k) }))
    }
    unsafe fn load_f32(p: *const f32) -> Self {
        // SAFETY: the caller's contract.
        Portable(std::array::from_fn(|k| unsafe { *p.add(k) }))
    }
    unsafe fn store_f32(self, p: *mut f32) {
        for (k, v) in self.0.iter().enumerate() {
            // SAFETY: the caller's contract.
            unsafe { *p.add(k) = *v };
        }
    }
    unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k].mul_add(b.0[k], c.0[k])))
    }
    unsafe fn mul(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k] * b.0[k]))
    }
    unsafe fn add(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k] + b.0[k]))
    }
    unsafe fn sub(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k] - b.0[k]))
    }
    unsafe fn max(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k].max(b.0[k])))
    }
    unsafe fn min(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k].min(b.0[k])))
    }
    unsafe fn div(a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| a.0[k] / b.0[k]))
    }
    unsafe fn abs(self) -> Self {
        Portable(self.0.map(f32::abs))
    }
    unsafe fn copy_sign(self, sign: Self) -> Self {
        Portable(std::array::from_fn(|k| self.0[k].copysign(sign.0[k])))
    }
    unsafe fn select_below(x: Self, limit: f32, a: Self, b: Self) -> Self {
        Portable(std::array::from_fn(|k| if x.0[k] < limit { a.0[k] } else { b.0[k] }))
    }
    unsafe fn keep(self, lo: usize, hi: usize, fill: f32) -> Self {
        Portable(std::array::from_fn(|k| if (lo..hi).contains(&k) { self.0[k] } else { fill }))
    }
    unsafe fn exp(self) -> Self {
        Portable(self.0.map(f32::exp))
    }
    unsafe fn exp1(x: f32) -> f32 {
        x.exp()
    }
    unsafe fn reduce_max(self) -> f32 {
        self.0.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }
    unsafe fn reduce_add(self) -> f32 {
        let v: [f32; 8] = std::array::from_fn(|k| self.0[k] + self.0[k + 8]);
        // `x86::hsum`'s tree: halves, then pairs, then the last two.
        let h: [f32; 4] = std::array::from_fn(|k| v[k] + v[k + 4]);
        let h = [h[0] + h[2], h[1] + h[3]];
        h[0] + h[1]
    }
    unsafe fn load1<const D: u8>(p: *const u8, i: usize) -> f32 {
        // SAFETY: the caller's contract (element `i` readable); reads are unaligned.
        unsafe {
            match D {
                DT_BF16 => f32::from_bits((std::ptr::read_unaligned(p.add(i * 2) as *const u16) as u32) << 16),
                DT_F16 => half::f16::from_bits(std::ptr::read_unaligned(p.add(i * 2) as *const u16)).to_f32(),
                _ => std::ptr::read_unaligned(p.add(i * 4) as *const f32),
            }
        }
    }
    unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
}

/// The x86 implementations (AVX-512: one zmm; AVX2: two ymm) and their entry points.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{Job, Lanes, PartialStats, QueryRow, Stats, merge_body, rows_body};
    use crate::x86::{exp8, exp16, hsum};

    /// Writes one position's key `src` (f32, an even `head_dim`) rounded to BF16 into a
    /// [`super::KvLayout::Pairs`] tile: the u32 of pair `p` (dimensions `2p`, `2p + 1`) at byte
    /// `64 · p` from `first`, the position's lane of the first pair. Each pair is rounded as
    /// `half::bf16::from_f32` rounds (`crate::amx::round16`), so the bits are the scalar path's.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL are available; the 4 bytes at `first + 64 · p` are writable for every
    /// `p < src.len() / 2`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn store_key_pairs_bf16(first: *mut u8, src: &[f32]) {
        let offsets = _mm512_setr_epi32(0, 64, 128, 192, 256, 320, 384, 448, 512, 576, 640, 704, 768, 832, 896, 960);
        for c in (0..src.len()).step_by(32) {
            let n = 32.min(src.len() - c);
            // SAFETY: `src[c..c + n]` is readable; pairs `c / 2 .. (c + n) / 2` are writable.
            unsafe {
                let pairs = crate::amx::round32(src.as_ptr().add(c), n);
                let mask = ((1u32 << (n / 2)) - 1) as __mmask16;
                _mm512_mask_i32scatter_epi32::<1>(first.add(c / 2 * 64) as *mut i32, mask, offsets, pairs);
            }
        }
    }

    /// Writes one position's value `src` (f32) rounded to BF16 into its half (the high one if
    /// `odd`) of a [`super::KvLayout::Pairs`] pair row: element `c` in the u32 at byte `4c` from
    /// `pair_row`, the other half untouched. Rounded as [`store_key_pairs_bf16`] rounds.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL are available; the `4 · src.len()` bytes from `pair_row` are writable.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub(super) unsafe fn store_value_pairs_bf16(pair_row: *mut u8, odd: bool, src: &[f32]) {
        for c in (0..src.len()).step_by(16) {
            let n = 16.min(src.len() - c);
            // SAFETY: `src[c..c + n]` is readable; the masked store writes only the `n` halves
            // of u32s `c..c + n`.
            unsafe {
                let rounded =
                    crate::amx::round16(_mm512_maskz_loadu_ps(((1u32 << n) - 1) as __mmask16, src.as_ptr().add(c)));
                let (halves, lanes) =
                    if odd { (_mm512_slli_epi32::<16>(rounded), 0xAAAA_AAAAu32) } else { (rounded, 0x5555_5555) };
                let in_range = if n == 16 { u32::MAX } else { (1u32 << (2 * n)) - 1 };
                _mm512_mask_storeu_epi16(pair_row.add(c * 4) as *mut i16, lanes & in_range, halves);
            }
        }
    }

    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C are available; as [`super::rows_body`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx512<const D: u8>(rows: &mut [QueryRow<'_>], job: &Job<'_>) -> Stats {
        // SAFETY: the caller's contract.
        unsafe { rows_body::<Zmm, D>(rows, job) }
    }

    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C are available.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn merge_avx512(stats: &[PartialStats], o: &[f32], out: &mut [f32]) -> PartialStats {
        // SAFETY: the caller's contract.
        unsafe { merge_body::<Zmm>(stats, o, out) }
    }

    /// [`super::tanh_lanes`] on AVX-512 lanes (for the accuracy test).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL, AVX2, FMA and F16C are available.
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn tanh_avx512(x: &[f32; 16]) -> [f32; 16] {
        let mut out = [0.0; 16];
        // SAFETY: the caller's contract; both arrays hold sixteen f32.
        unsafe { super::tanh_lanes(Zmm::load_f32(x.as_ptr())).store_f32(out.as_mut_ptr()) };
        out
    }

    /// [`super::tanh_lanes`] on AVX2 lanes (for the accuracy test).
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available.
    #[cfg(test)]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tanh_avx2(x: &[f32; 16]) -> [f32; 16] {
        let mut out = [0.0; 16];
        // SAFETY: the caller's contract; both arrays hold sixteen f32.
        unsafe { super::tanh_lanes(Ymm2::load_f32(x.as_ptr())).store_f32(out.as_mut_ptr()) };
        out
    }

    /// # Safety
    /// AVX2, FMA and F16C are available.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn merge_avx2(stats: &[PartialStats], o: &[f32], out: &mut [f32]) -> PartialStats {
        // SAFETY: the caller's contract.
        unsafe { merge_body::<Ymm2>(stats, o, out) }
    }

    /// # Safety
    /// AVX2, FMA and F16C are available; as [`super::rows_body`].
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn rows_avx2<const D: u8>(rows: &mut [QueryRow<'_>], job: &Job<'_>) -> Stats {
        // SAFETY: the caller's contract.
        unsafe { rows_body::<Ymm2, D>(rows, job) }
    }

    #[derive(Clone, Copy)]
    pub(super) struct Zmm(pub(super) __m512);

    // SAFETY (every method): only called from `rows_avx512`'s body, where the features are
    // enabled; pointer arguments follow the trait's contracts.
    impl Lanes for Zmm {
        const MICRO_ROWS: usize = 12;
        const PAIRED_ROWS: usize = 12;
        const WIDE_PASSES: bool = true;
        const PREFETCH_VALUES: bool = false;
        micro_rows_body!(1 2 3 4 5 6 7 8 9 10 11 12);
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Zmm(_mm512_setzero_ps()) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            unsafe { Zmm(_mm512_set1_ps(x)) }
        }
        #[inline(always)]
        unsafe fn load<const D: u8>(p: *const u8, i: usize) -> Self {
            unsafe { Zmm(crate::avx512::load16::<D>(p, i)) }
        }
        #[inline(always)]
        unsafe fn load_f32(p: *const f32) -> Self {
            unsafe { Zmm(_mm512_loadu_ps(p)) }
        }
        #[inline(always)]
        unsafe fn store_f32(self, p: *mut f32) {
            unsafe { _mm512_storeu_ps(p, self.0) }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            unsafe { Zmm(_mm512_fmadd_ps(a.0, b.0, c.0)) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_mul_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_add_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn sub(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_sub_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_max_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn min(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_min_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn div(a: Self, b: Self) -> Self {
            unsafe { Zmm(_mm512_div_ps(a.0, b.0)) }
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            unsafe { Zmm(_mm512_abs_ps(self.0)) }
        }
        #[inline(always)]
        unsafe fn copy_sign(self, sign: Self) -> Self {
            unsafe {
                let bit = _mm512_set1_epi32(i32::MIN);
                let mag = _mm512_andnot_si512(bit, _mm512_castps_si512(self.0));
                let sgn = _mm512_and_si512(bit, _mm512_castps_si512(sign.0));
                Zmm(_mm512_castsi512_ps(_mm512_or_si512(mag, sgn)))
            }
        }
        #[inline(always)]
        unsafe fn select_below(x: Self, limit: f32, a: Self, b: Self) -> Self {
            unsafe {
                let below = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x.0, _mm512_set1_ps(limit));
                Zmm(_mm512_mask_blend_ps(below, b.0, a.0))
            }
        }
        #[inline(always)]
        unsafe fn keep(self, lo: usize, hi: usize, fill: f32) -> Self {
            if lo == 0 && hi >= 16 {
                return self;
            }
            // Lanes `lo..hi`: the bits below `hi` without those below `lo`.
            let below = |n: usize| (1u32 << n.min(16)) - 1;
            let mask: __mmask16 = (below(hi) & !below(lo)) as u16;
            unsafe { Zmm(_mm512_mask_blend_ps(mask, _mm512_set1_ps(fill), self.0)) }
        }
        #[inline(always)]
        unsafe fn exp(self) -> Self {
            unsafe { Zmm(exp16(self.0)) }
        }
        #[inline(always)]
        unsafe fn exp1(x: f32) -> f32 {
            unsafe { _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))) }
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            unsafe { _mm512_reduce_max_ps(self.0) }
        }
        #[inline(always)]
        unsafe fn reduce_add(self) -> f32 {
            unsafe {
                let lo = _mm512_castps512_ps256(self.0);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(self.0)));
                hsum(_mm256_add_ps(lo, hi))
            }
        }
        #[inline(always)]
        unsafe fn load1<const D: u8>(p: *const u8, i: usize) -> f32 {
            unsafe { crate::x86::load1::<D>(p, i) }
        }
        #[inline(always)]
        unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
            unsafe { _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))) }
        }
    }

    #[derive(Clone, Copy)]
    pub(super) struct Ymm2([__m256; 2]);

    // SAFETY (every method): only called from `rows_avx2`'s body, where the features are
    // enabled; pointer arguments follow the trait's contracts.
    impl Lanes for Ymm2 {
        const MICRO_ROWS: usize = 6;
        const PAIRED_ROWS: usize = 3;
        const WIDE_PASSES: bool = false;
        const PREFETCH_VALUES: bool = true;
        micro_rows_body!(1 2 3 4 5 6);
        #[inline(always)]
        unsafe fn zero() -> Self {
            unsafe { Ymm2([_mm256_setzero_ps(); 2]) }
        }
        #[inline(always)]
        unsafe fn splat(x: f32) -> Self {
            unsafe { Ymm2([_mm256_set1_ps(x); 2]) }
        }
        #[inline(always)]
        unsafe fn load<const D: u8>(p: *const u8, i: usize) -> Self {
            unsafe { Ymm2([crate::x86::load8::<D>(p, i), crate::x86::load8::<D>(p, i + 8)]) }
        }
        #[inline(always)]
        unsafe fn load_f32(p: *const f32) -> Self {
            unsafe { Ymm2([_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]) }
        }
        #[inline(always)]
        unsafe fn store_f32(self, p: *mut f32) {
            unsafe {
                _mm256_storeu_ps(p, self.0[0]);
                _mm256_storeu_ps(p.add(8), self.0[1]);
            }
        }
        #[inline(always)]
        unsafe fn fma(a: Self, b: Self, c: Self) -> Self {
            unsafe { Ymm2([_mm256_fmadd_ps(a.0[0], b.0[0], c.0[0]), _mm256_fmadd_ps(a.0[1], b.0[1], c.0[1])]) }
        }
        #[inline(always)]
        unsafe fn mul(a: Self, b: Self) -> Self {
            unsafe { Ymm2([_mm256_mul_ps(a.0[0], b.0[0]), _mm256_mul_ps(a.0[1], b.0[1])]) }
        }
        #[inline(always)]
        unsafe fn add(a: Self, b: Self) -> Self {
            unsafe { Ymm2([_mm256_add_ps(a.0[0], b.0[0]), _mm256_add_ps(a.0[1], b.0[1])]) }
        }
        #[inline(always)]
        unsafe fn sub(a: Self, b: Self) -> Self {
            unsafe { Ymm2([_mm256_sub_ps(a.0[0], b.0[0]), _mm256_sub_ps(a.0[1], b.0[1])]) }
        }
        #[inline(always)]
        unsafe fn max(a: Self, b: Self) -> Self {
            unsafe { Ymm2([_mm256_max_ps(a.0[0], b.0[0]), _mm256_max_ps(a.0[1], b.0[1])]) }
        }
        #[inline(always)]
        unsafe fn min(a: Self, b: Self) -> Self {
            unsafe { Ymm2([_mm256_min_ps(a.0[0], b.0[0]), _mm256_min_ps(a.0[1], b.0[1])]) }
        }
        #[inline(always)]
        unsafe fn div(a: Self, b: Self) -> Self {
            unsafe { Ymm2([_mm256_div_ps(a.0[0], b.0[0]), _mm256_div_ps(a.0[1], b.0[1])]) }
        }
        #[inline(always)]
        unsafe fn abs(self) -> Self {
            unsafe {
                let bit = _mm256_set1_ps(-0.0);
                Ymm2([_mm256_andnot_ps(bit, self.0[0]), _mm256_andnot_ps(bit, self.0[1])])
            }
        }
        #[inline(always)]
        unsafe fn copy_sign(self, sign: Self) -> Self {
            unsafe {
                let bit = _mm256_set1_ps(-0.0);
                let one = |m: __m256, s: __m256| _mm256_or_ps(_mm256_andnot_ps(bit, m), _mm256_and_ps(bit, s));
                Ymm2([one(self.0[0], sign.0[0]), one(self.0[1], sign.0[1])])
            }
        }
        #[inline(always)]
        unsafe fn select_below(x: Self, limit: f32, a: Self, b: Self) -> Self {
            unsafe {
                let l = _mm256_set1_ps(limit);
                let one = |x: __m256, a: __m256, b: __m256| _mm256_blendv_ps(b, a, _mm256_cmp_ps::<_CMP_LT_OQ>(x, l));
                Ymm2([one(x.0[0], a.0[0], b.0[0]), one(x.0[1], a.0[1], b.0[1])])
            }
        }
        #[inline(always)]
        unsafe fn keep(self, lo: usize, hi: usize, fill: f32) -> Self {
            if lo == 0 && hi >= 16 {
                return self;
            }
            unsafe {
                // Lane indices above `lo - 1` and below `hi` (both at most 16).
                let low = _mm256_set1_epi32(lo.min(16) as i32 - 1);
                let high = _mm256_set1_epi32(hi.min(16) as i32);
                let f = _mm256_set1_ps(fill);
                let lanes =
                    [_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)];
                let pick = |v: __m256, idx: __m256i| {
                    // Lanes whose index is in `lo..hi` keep `v`.
                    let inside = _mm256_and_si256(_mm256_cmpgt_epi32(high, idx), _mm256_cmpgt_epi32(idx, low));
                    _mm256_blendv_ps(f, v, _mm256_castsi256_ps(inside))
                };
                Ymm2([pick(self.0[0], lanes[0]), pick(self.0[1], lanes[1])])
            }
        }
        #[inline(always)]
        unsafe fn exp(self) -> Self {
            unsafe { Ymm2([exp8(self.0[0]), exp8(self.0[1])]) }
        }
        #[inline(always)]
        unsafe fn exp1(x: f32) -> f32 {
            unsafe { _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))) }
        }
        #[inline(always)]
        unsafe fn reduce_max(self) -> f32 {
            unsafe { crate::x86::hmax(_mm256_max_ps(self.0[0], self.0[1])) }
        }
        #[inline(always)]
        unsafe fn reduce_add(self) -> f32 {
            unsafe { hsum(_mm256_add_ps(self.0[0], self.0[1])) }
        }
        #[inline(always)]
        unsafe fn load1<const D: u8>(p: *const u8, i: usize) -> f32 {
            unsafe { crate::x86::load1::<D>(p, i) }
        }
        #[inline(always)]
        unsafe fn fma1(a: f32, b: f32, c: f32) -> f32 {
            unsafe { _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(a), _mm_set_ss(b), _mm_set_ss(c))) }
        }
    }
}

/// Writes `src` (f32) into `dst` elements `at..at + src.len()` of a pool of element type `dtype`
/// (rounding to nearest even for F16 and BF16): a value row. Panics if out of range.
pub fn store_row(dtype: WeightDType, dst: &mut [u8], at: usize, src: &[f32]) {
    scatter(dtype, dst, at, src, |c| c);
}

/// Writes the key `src` (f32, `head_dim`) of position `slot` into the (block, layer, head)
/// tile that starts at element `tile` of `dst`, in `layout`. Panics if out of range.
pub fn store_key(
    layout: KvLayout,
    dtype: WeightDType,
    dst: &mut [u8],
    tile: usize,
    block_size: usize,
    slot: usize,
    src: &[f32],
) {
    assert!(slot < block_size, "slot {slot} outside a block of {block_size}");
    let hd = src.len();
    match layout {
        // (head_dim, block_size).
        KvLayout::Standard => scatter(dtype, dst, tile, src, |c| c * block_size + slot),
        // (block_size / 16, head_dim / 2, 16, 2).
        KvLayout::Pairs => {
            let (chunk, lane) = ((slot / 16) * (hd / 2), (slot % 16) * 2);
            #[cfg(target_arch = "x86_64")]
            if dtype == WeightDType::BF16 && hd.is_multiple_of(2) && isa() == Isa::Avx512 {
                // Pair `p` (dimensions 2p and 2p + 1) is one u32, 32 elements after pair p - 1.
                let first = tile + chunk * 32 + lane;
                let end = first + hd.saturating_sub(2) / 2 * 32 + 2;
                assert!(end * 2 <= dst.len(), "store_key: elements up to {end} outside a pool of {}", dst.len() / 2);
                // SAFETY: AVX-512 F/BW/VL were detected; every pair's u32 lies below `end`.
                unsafe { simd::store_key_pairs_bf16(dst.as_mut_ptr().add(first * 2), src) };
                return;
            }
            scatter(dtype, dst, tile, src, |c| (chunk + c / 2) * 32 + lane + c % 2)
        }
    }
}

/// Writes the value `src` (f32, `head_dim`) of position `slot` into the (block, layer, head)
/// tile that starts at element `tile` of `dst`, in `layout`. Panics if out of range.
pub fn store_value(
    layout: KvLayout,
    dtype: WeightDType,
    dst: &mut [u8],
    tile: usize,
    block_size: usize,
    slot: usize,
    src: &[f32],
) {
    assert!(slot < block_size, "slot {slot} outside a block of {block_size}");
    let hd = src.len();
    match layout {
        // (block_size, head_dim).
        KvLayout::Standard => store_row(dtype, dst, tile + slot * hd, src),
        // (block_size / 2, head_dim, 2).
        KvLayout::Pairs => {
            let pair_row = (slot / 2) * hd * 2;
            let first = pair_row + slot % 2;
            #[cfg(target_arch = "x86_64")]
            if dtype == WeightDType::BF16 && isa() == Isa::Avx512 {
                let end = tile + first + 2 * hd.saturating_sub(1) + 1;
                assert!(end * 2 <= dst.len(), "store_value: elements up to {end} outside a pool of {}", dst.len() / 2);
                // SAFETY: AVX-512 F/BW/VL were detected; element `c` (at `first + 2c` of the
                // tile) lies below `end`.
                unsafe {
                    simd::store_value_pairs_bf16(dst.as_mut_ptr().add((tile + pair_row) * 2), slot % 2 == 1, src)
                };
                return;
            }
            scatter(dtype, dst, tile, src, |c| first + 2 * c)
        }
    }
}

/// Writes `src[c]`, rounded to `dtype` (to nearest even for F16 and BF16), into element
/// `tile + index(c)` of `dst` for every `c`: the one loop of [`store_row`], [`store_key`] and
/// [`store_value`], with the element type chosen once per call, not once per element, so that
/// each type's loop is compiled on its own. Panics if out of range.
#[inline]
fn scatter(dtype: WeightDType, dst: &mut [u8], tile: usize, src: &[f32], index: impl Fn(usize) -> usize) {
    #[inline(always)]
    fn each<const N: usize>(
        dst: &mut [u8],
        tile: usize,
        src: &[f32],
        index: impl Fn(usize) -> usize,
        bytes: impl Fn(f32) -> [u8; N],
    ) {
        for (c, &v) in src.iter().enumerate() {
            let at = (tile + index(c)) * N;
            dst[at..at + N].copy_from_slice(&bytes(v));
        }
    }
    match dtype {
        WeightDType::F32 => each(dst, tile, src, index, f32::to_le_bytes),
        WeightDType::F16 => each(dst, tile, src, index, |v| half::f16::from_f32(v).to_le_bytes()),
        WeightDType::BF16 => each(dst, tile, src, index, |v| half::bf16::from_f32(v).to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The soft cap's tanh on every lane implementation this CPU runs, against f64's: within
    /// 1e-6 relative (or 1e-30 absolute, near zero) over small, medium, saturating and
    /// infinite arguments, odd, and ±1 (never NaN) at the ends.
    #[test]
    fn lane_tanh_is_accurate() {
        let mut xs: Vec<f32> = (-400_000..=400_000).map(|i| i as f32 * 5e-5).collect();
        xs.extend((-60..=60).map(|e| 2f32.powi(e)));
        for edge in [0.625f32, 10.0] {
            let mut below = edge;
            let mut above = edge;
            for _ in 0..64 {
                below = f32::from_bits(below.to_bits() - 1);
                above = f32::from_bits(above.to_bits() + 1);
                xs.extend([below, above]);
            }
        }
        xs.extend([0.0, -0.0, 50.0, 1e30, f32::MAX, f32::INFINITY, 1e-40]);
        let negated: Vec<f32> = xs.iter().map(|x| -x).collect();
        xs.extend(negated);
        xs.resize(xs.len().div_ceil(16) * 16, 0.0);
        type Tanh16 = fn(&[f32; 16]) -> [f32; 16];
        let mut impls: Vec<(&str, Tanh16)> = vec![("portable", |x| {
            let mut out = [0.0; 16];
            // SAFETY: the portable lanes need no instructions; both arrays hold sixteen f32.
            unsafe { tanh_lanes(Portable::load_f32(x.as_ptr())).store_f32(out.as_mut_ptr()) };
            out
        })];
        #[cfg(target_arch = "x86_64")]
        {
            if isa() != Isa::Scalar {
                // SAFETY: AVX2, FMA and F16C were detected.
                impls.push(("avx2", |x| unsafe { simd::tanh_avx2(x) }));
            }
            if isa() == Isa::Avx512 {
                // SAFETY: AVX-512 F/BW/VL were detected with AVX2, FMA and F16C.
                impls.push(("avx512", |x| unsafe { simd::tanh_avx512(x) }));
            }
        }
        for (name, tanh) in impls {
            let mut worst = 0.0f64;
            for chunk in xs.chunks_exact(16) {
                let got = tanh(chunk.try_into().expect("sixteen lanes"));
                for (&x, &y) in chunk.iter().zip(&got) {
                    let want = (x as f64).tanh();
                    assert!(!y.is_nan() && y.abs() <= 1.0, "{name}: tanh({x}) = {y}");
                    assert_eq!(y.is_sign_negative(), x.is_sign_negative(), "{name}: tanh({x}) = {y}");
                    let err = (y as f64 - want).abs();
                    if err > 1e-30 {
                        worst = worst.max(err / want.abs());
                    }
                }
            }
            assert!(worst <= 1e-6, "{name}: relative error {worst:e}");
            eprintln!("{name}: tanh's largest relative error {worst:e}");
        }
    }
}
