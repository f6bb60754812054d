//! Self-attention with grouped KV heads over a paged KV cache: the shared block every family's
//! attention layers run, with the family's choices made when the layer is built (q/k norms per
//! head or over the projection, an unweighted value norm, RoPE from the layer's table or none,
//! a sliding window, the score scale and soft cap, keys and values shared with an earlier
//! layer, values that are the keys' projection).
//!
//! Guarantees: every shape is checked in [`Attention::new`]; [`Attention::forward`] allocates
//! nothing, and gives each query row the same bits whatever else is in the batch (the paged
//! kernels reduce in one canonical order; split-K partitions are merged in order).

use kylin_kernels::paged::{MAX_HEAD_DIM, MAX_ROWS, PARTITION, PartialStats, QueryRow, ScoreMap};
use kylin_kernels::{self as kernels};
use kylin_loader::arch::Role;
use kylin_loader::family::{LayerSpec, QkNorm};
use kylin_loader::{KylinError, LayerWeights, ModelConfig, ModelWeights, Result};

use super::linear::{Linear, Norm, Vector};
use super::scratch::Scratch;
use super::{BatchPlan, Outputs, Segment, Step};
use crate::kv_pool::{KvPool, KvShape};
use crate::rope::Ropes;
use crate::shared_mut::SharedMut;

/// One layer's attention, with the family's choices made.
#[derive(Debug, Clone)]
pub(super) struct Attention {
    q_proj: Linear,
    /// Absent on a layer that reuses an earlier layer's keys and values (Gemma 4).
    k_proj: Option<Linear>,
    /// Absent as well when the values are the key projection's output (`attention_k_eq_v`).
    v_proj: Option<Linear>,
    o_proj: Linear,
    /// On q and k before RoPE: per head `(head_dim)` (Qwen3, Gemma 3) or over the whole
    /// projection (OLMo 2), as `qk_norm` says.
    q_norm: Option<Norm>,
    k_norm: Option<Norm>,
    qk_norm: QkNorm,
    /// On each value head, without a weight (Gemma 4).
    v_norm: Option<Norm>,
    /// The score scale and soft cap.
    scores: ScoreMap,
    /// A sink logit per query head joining every softmax's denominator (gpt-oss).
    sinks: Option<Vec<f32>>,
    /// The sinks' bytes as stored (they are widened to f32 at load).
    pub(super) sink_bytes: u64,
    pub(super) head_dim: usize,
    pub(super) n_kv_heads: usize,
    /// A sliding window of this many positions, the query's own included.
    pub(super) window: Option<usize>,
    /// Where the layer's keys and values live: its index among the layers of its KV pool,
    /// and whether that is the sliding layers' pool (`KvGroups`). A layer that reuses an
    /// earlier layer's keys and values has that layer's place.
    pub(super) kv_slot: usize,
    pub(super) in_sliding_pool: bool,
    /// Index of the layer's table in [`Ropes`], or no RoPE.
    rope: Option<usize>,
    /// `q_proj` gives each head its queries and then as many gate values, and the output is
    /// `attention · sigmoid(gate)` before `o_proj` (Qwen3.5).
    output_gate: bool,
}

impl Attention {
    /// Binds layer `index`'s attention (`rope`: the index of its rotary table, if any),
    /// checking every shape.
    pub(super) fn new(
        w: &LayerWeights,
        index: usize,
        config: &ModelConfig,
        layer: &LayerSpec,
        rope: Option<usize>,
        weights: &ModelWeights,
    ) -> Result<Self> {
        let spec = &config.decoder;
        let (head_dim, n_kv_heads, n_heads, hidden) =
            (layer.head_dim, layer.num_kv_heads, config.num_heads, config.hidden_size);
        if head_dim == 0 || head_dim > MAX_HEAD_DIM {
            return Err(KylinError::operator_unsupported(format!(
                "layer {index}'s head_dim {head_dim} is outside the attention kernels' range 1..={MAX_HEAD_DIM}"
            )));
        }
        if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) {
            return Err(KylinError::config_invalid(format!(
                "layer {index}: num_attention_heads ({n_heads}) must be a non-zero multiple of its key-value heads ({n_kv_heads})"
            )));
        }
        let (q_dim, kv_dim) = (n_heads * head_dim, n_kv_heads * head_dim);
        let linear = |weight: Role, bias: Role, rows: usize, cols: usize| -> Result<Linear> {
            Linear::bind(w.require(weight, index)?, w.get(bias), rows, cols, weights)
        };
        let norm = |role: Role, len: usize| -> Result<Norm> { Norm::new(w.require(role, index)?, len, spec.norm) };
        let (q_norm_len, k_norm_len) = match spec.qk_norm {
            QkNorm::None => (0, 0),
            QkNorm::PerHead => (head_dim, head_dim),
            QkNorm::Projection => (q_dim, kv_dim),
        };
        let own_kv = layer.has_kv_projections();
        let output_gate = spec.attention_output_gate;
        let q_rows = if output_gate { 2 * q_dim } else { q_dim };
        Ok(Attention {
            q_proj: linear(Role::QProj, Role::QBias, q_rows, hidden)?,
            k_proj: own_kv.then(|| linear(Role::KProj, Role::KBias, kv_dim, hidden)).transpose()?,
            v_proj: layer
                .has_value_projection()
                .then(|| linear(Role::VProj, Role::VBias, kv_dim, hidden))
                .transpose()?,
            o_proj: linear(Role::OProj, Role::OBias, hidden, q_dim)?,
            q_norm: (spec.qk_norm != QkNorm::None).then(|| norm(Role::QNorm, q_norm_len)).transpose()?,
            k_norm: (spec.qk_norm != QkNorm::None && own_kv).then(|| norm(Role::KNorm, k_norm_len)).transpose()?,
            qk_norm: spec.qk_norm,
            v_norm: (spec.value_norm && own_kv).then(|| Norm::unweighted(head_dim)),
            scores: ScoreMap { scale: spec.attention_scale as f32, softcap: spec.attention_softcap.map(|c| c as f32) },
            sinks: if spec.attention_sinks {
                Some(Vector::new(w.require(Role::Sinks, index)?, n_heads)?.values())
            } else {
                None
            },
            sink_bytes: if spec.attention_sinks { w.require(Role::Sinks, index)?.byte_len() as u64 } else { 0 },
            head_dim,
            n_kv_heads,
            window: layer.window,
            kv_slot: index,
            in_sliding_pool: false,
            rope,
            output_gate,
        })
    }

    /// The projections with their roles, in the order q, k, v, o (k and v where the layer has them).
    pub(super) fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        [
            (Role::QProj, Some(&self.q_proj)),
            (Role::KProj, self.k_proj.as_ref()),
            (Role::VProj, self.v_proj.as_ref()),
            (Role::OProj, Some(&self.o_proj)),
        ]
        .into_iter()
        .filter_map(|(role, m)| m.map(|m| (role, m)))
    }

    pub(super) fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        [Some(&mut self.q_proj), self.k_proj.as_mut(), self.v_proj.as_mut(), Some(&mut self.o_proj)]
            .into_iter()
            .flatten()
    }

    /// The q and k norms' weights.
    pub(super) fn norms(&self) -> impl Iterator<Item = &Norm> {
        [&self.q_norm, &self.k_norm].into_iter().flatten()
    }

    /// Whether `q_proj` carries an output gate (Qwen3.5).
    pub(super) fn has_output_gate(&self) -> bool {
        self.output_gate
    }

    /// Whether the layer computes and stores its own keys and values.
    pub(super) fn owns_kv(&self) -> bool {
        self.k_proj.is_some()
    }

    /// Keys and values this layer keeps per position.
    pub(super) fn kv_shape(&self) -> KvShape {
        KvShape { n_kv_heads: self.n_kv_heads, head_dim: self.head_dim }
    }

    /// Attention over every segment of the batch: `proj (rows, hidden) =
    /// o_proj(attention(rope(qk_norm?(q)), rope(qk_norm?(k)), v))`, where q, k, v are
    /// projections of `xn` (`normed`) or of the residual stream `x`; every token's keys and
    /// values are stored in the layer's place of `kv`. The output rows are every token's, or
    /// only those of the tokens whose logits are wanted, in logits-row order (`outputs`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        c: &Step<'_>,
        kv: &mut KvPool,
        rope: &Ropes,
        s: &mut Scratch,
        plan: &BatchPlan,
        normed: bool,
        outputs: Outputs,
    ) {
        let mm = c.mm;
        let layer = self;
        let n = plan.tokens();
        let hd = layer.head_dim;
        let (h, q_dim, kv_dim) = (c.hidden, c.n_heads * hd, layer.n_kv_heads * hd);
        // The layer's index in its pool, and each segment's table there.
        let index = layer.kv_slot;
        let table_range = |seg: &Segment| -> std::ops::Range<usize> {
            if layer.in_sliding_pool { seg.sb0..seg.sb0 + seg.snb } else { seg.b0..seg.b0 + seg.nb }
        };
        let tables = if layer.in_sliding_pool { &plan.sliding_block_ids } else { &plan.block_ids };

        let input = if normed { &s.xn[..n * h] } else { &s.x[..n * h] };

        // 1. Projections over all tokens of all segments: input (n, hidden) -> q (n, n_heads * head_dim),
        //    k and v (n, n_kv_heads * head_dim). A layer reusing an earlier layer's keys and
        //    values projects only q; one whose values are its keys' projection copies k to v
        //    before k is normed and rotated.
        //    A gated layer's q_proj gives (n, heads, 2 · head_dim): each head's queries, then its
        //    gate; the queries are copied to q below, the gate stays for step 4.
        let q_out = if layer.output_gate { &mut s.q_gate[..n * 2 * q_dim] } else { &mut s.q[..n * q_dim] };
        let (k_out, v_out) = (&mut s.k[..n * kv_dim], &mut s.v[..n * kv_dim]);
        match (&layer.k_proj, &layer.v_proj) {
            (Some(k_proj), Some(v_proj)) => Linear::forward_many(
                mm,
                input,
                n,
                [(&layer.q_proj, q_out), (k_proj, &mut *k_out), (v_proj, v_out)],
                &mut s.products,
            ),
            (Some(k_proj), None) => {
                Linear::forward_many(mm, input, n, [(&layer.q_proj, q_out), (k_proj, &mut *k_out)], &mut s.products);
                v_out.copy_from_slice(k_out);
            }
            (None, _) => layer.q_proj.forward(mm, input, n, q_out, &mut s.products),
        }
        if layer.output_gate {
            // (n, heads, [queries | gate]) -> q (n, heads, head_dim).
            for t in 0..n {
                for head in 0..c.n_heads {
                    let from = t * 2 * q_dim + head * 2 * hd;
                    s.q[t * q_dim + head * hd..t * q_dim + (head + 1) * hd].copy_from_slice(&s.q_gate[from..from + hd]);
                }
            }
        }

        // 2. The q/k norm (per head, or over the whole projection), then RoPE at each token's
        //    own position on the rotated part of every (token, head) row of q and k, viewed as
        //    (n, heads, head_dim); the value norm (Gemma 4) on each value head; then the
        //    tokens' keys and values go to their sequences' blocks. Tokens are independent,
        //    so they are split over the pool, unless a token needs the scratch's one buffer
        //    for its rotary frequencies (multimodal RoPE) or for a norm over the whole
        //    projection (OLMo 2).
        let table = layer.rope.map(|i| rope.table(i));
        let rotary = table.map_or(0, |t| t.rotary_dim());
        let multimodal = table.filter(|t| t.is_multimodal() && !plan.positions.is_empty());
        let writes_kv = layer.k_proj.is_some();
        let projection_norm = layer.qk_norm == QkNorm::Projection && (layer.q_norm.is_some() || layer.k_norm.is_some());
        // One token's rows in place: q (q_dim), and k and v (kv_dim) when the layer writes them.
        let token_rows =
            |q: &mut [f32], kv: Option<(&mut [f32], &mut [f32])>, tmp: &mut [f32], cos: &[f32], sin: &[f32]| {
                let (k, v) = kv.map_or((None, None), |(k, v)| (Some(k), Some(v)));
                let rows = [Some((q, q_dim, &layer.q_norm)), k.map(|k| (k, kv_dim, &layer.k_norm))];
                for (row, width, head_norm) in rows.into_iter().flatten() {
                    debug_assert_eq!(row.len(), width);
                    if let (Some(w), QkNorm::Projection) = (head_norm, layer.qk_norm) {
                        // (width) -> (width): one norm over every head of the token.
                        tmp[..width].copy_from_slice(row);
                        w.apply(&tmp[..width], c.eps, row);
                    }
                    for head in row.chunks_exact_mut(hd) {
                        if let (Some(w), QkNorm::PerHead) = (head_norm, layer.qk_norm) {
                            tmp[..hd].copy_from_slice(head);
                            w.apply(&tmp[..hd], c.eps, head);
                        }
                        if table.is_some() {
                            kernels::rope_rotate_half(&mut head[..rotary], cos, sin);
                        }
                    }
                }
                if let (Some(v), Some(norm)) = (v, &layer.v_norm) {
                    for head in v.chunks_exact_mut(hd) {
                        tmp[..hd].copy_from_slice(head);
                        norm.apply(&tmp[..hd], c.eps, head);
                    }
                }
            };
        let segments = &plan.segments;
        let position = |seg: &Segment, t: usize| seg.start + (t - seg.t0);
        if multimodal.is_none() && !projection_norm && hd <= MAX_HEAD_DIM {
            let (q_all, k_all, v_all) = (
                SharedMut::new(&mut s.q[..n * q_dim]),
                SharedMut::new(&mut s.k[..n * kv_dim]),
                SharedMut::new(&mut s.v[..n * kv_dim]),
            );
            super::for_row_ranges(mm.pool, n, q_dim + 2 * kv_dim, &|tokens| {
                let mut tmp = [0.0f32; MAX_HEAD_DIM];
                // The segment holding the range's first token, then the following ones.
                let mut si = plan.segment_of(tokens.start);
                for t in tokens {
                    while t >= segments[si].t0 + segments[si].n {
                        si += 1;
                    }
                    let pos = position(&segments[si], t);
                    let (cos, sin): (&[f32], &[f32]) = table.map_or((&[], &[]), |tb| (tb.cos(pos), tb.sin(pos)));
                    // SAFETY: token t's rows belong to the one range holding t, and the
                    // buffers outlive the call.
                    let (q, kv) = unsafe {
                        let q = q_all.slice(t * q_dim, q_dim);
                        (q, writes_kv.then(|| (k_all.slice(t * kv_dim, kv_dim), v_all.slice(t * kv_dim, kv_dim))))
                    };
                    token_rows(q, kv, &mut tmp, cos, sin);
                }
            });
        } else {
            // Multimodal RoPE: each token's frequencies at its (time, row, column) positions.
            let (mm_cos, mm_sin) = s.rope_tmp[..rotary].split_at_mut(rotary / 2);
            for seg in segments {
                for t in seg.t0..seg.t0 + seg.n {
                    let pos = position(seg, t);
                    let (cos, sin): (&[f32], &[f32]) = match (table, multimodal) {
                        (_, Some(mm)) => {
                            mm.cos_sin_at(plan.positions[t], mm_cos, mm_sin);
                            (mm_cos, mm_sin)
                        }
                        (Some(table), None) => (table.cos(pos), table.sin(pos)),
                        (None, None) => (&[], &[]),
                    };
                    let q = &mut s.q[t * q_dim..(t + 1) * q_dim];
                    let kv = writes_kv
                        .then(|| (&mut s.k[t * kv_dim..(t + 1) * kv_dim], &mut s.v[t * kv_dim..(t + 1) * kv_dim]));
                    token_rows(q, kv, &mut s.head_tmp, cos, sin);
                }
            }
        }
        if writes_kv {
            // k, v (n, n_kv_heads * head_dim) -> each token's block slot, per KV head.
            let place = |t: usize| {
                let seg = &segments[plan.segment_of(t)];
                (&tables[table_range(seg)], position(seg, t))
            };
            kv.store_tokens(mm.pool, index, n, &place, &s.k[..n * kv_dim], &s.v[..n * kv_dim]);
        }

        // 3. Causal attention, blocked: one pool task per (segment, KV head, chunk of up to
        //    MAX_ROWS of its (token, query head) rows, token-major), so each tile of the head's
        //    cached keys and values is read once for the whole chunk; query t of a segment attends
        //    to positions 0..=start + t of its own sequence (or up to the end of its image, for
        //    Gemma 3's image tokens and Gemma 4's on sliding layers: `plan.attend_until`). The kernel gives every row the same
        //    bits whatever chunk it is in (batch invariance).
        //    Split-K: when that makes fewer than two tasks per thread (one or a few sequences
        //    decoding on a model with few KV heads), each decode segment reaching past one
        //    partition gets one task per (KV head, partition of PARTITION positions), and the
        //    partitions' states are folded in order afterwards, which gives the same bits as
        //    one task. Only the tokens that get an output are queried (`outputs`), each into
        //    its output row.
        //    q (n, n_heads, head_dim) -> attn (rows, n_heads, head_dim).
        let kv: &KvPool = kv;
        let (keys, values) = kv.views(index);
        let group = c.n_heads / layer.n_kv_heads;
        let scores = layer.scores;
        // A sliding layer's query at position p attends to p + 1 - window ..= p.
        let window = layer.window;
        let first_position = |pos: usize| window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let (n_kv, n_heads) = (layer.n_kv_heads, c.n_heads);
        let q = &s.q[..n * q_dim];
        let attn = SharedMut::new(&mut s.attn[..n * q_dim]);
        let segments = &plan.segments;
        // Tasks of segment i are task_start[i]..task_start[i + 1]: its KV heads, each cut into
        // chunks of MAX_ROWS rows of the tokens that get an output, or into partitions when
        // split.
        let chunks = |seg: &Segment| (outputs.span(seg).2 * group).div_ceil(MAX_ROWS);
        let parts = |seg: &Segment| (seg.start + seg.n).div_ceil(PARTITION);
        let unsplit: usize = segments.iter().map(|seg| n_kv * chunks(seg)).sum();
        let split_wanted = unsplit < 2 * mm.pool.threads() && segments.len() <= s.split_segments;
        let is_split = |seg: &Segment| {
            split_wanted && seg.n == 1 && outputs.span(seg).2 == 1 && group <= MAX_ROWS && parts(seg) > 1
        };
        let max_parts = s.split_parts;
        let split_out = SharedMut::new(&mut s.split_outputs);
        let states = SharedMut::new(&mut s.split_stats);
        let task_start = &mut s.attention_tasks[..segments.len() + 1];
        task_start[0] = 0;
        for (i, seg) in segments.iter().enumerate() {
            let per_head = if is_split(seg) { parts(seg) } else { chunks(seg) };
            task_start[i + 1] = task_start[i] + n_kv * per_head;
        }
        let task_start = &*task_start;
        mm.pool.run(task_start[segments.len()], &|task| {
            // The task's segment, KV head and range of rows (or partition).
            let si = task_start.partition_point(|&t| t <= task) - 1;
            let seg = segments[si];
            let local = task - task_start[si];
            let blocks = &tables[table_range(&seg)];
            let mut rows: [QueryRow<'_>; MAX_ROWS] =
                std::array::from_fn(|_| QueryRow { q: &[], from: 0, len: 0, out: &mut [] });
            if is_split(&seg) {
                // One token: the group's query heads over one partition, into the split buffers
                // at (split slot, head, partition).
                let (kv_head, part) = (local / parts(&seg), local % parts(&seg));
                // The one token's queries (its output row is chosen when the partitions fold).
                let slot = segments[..si].iter().filter(|s| is_split(s)).count();
                let first_row = (slot * n_heads + kv_head * group) * max_parts + part;
                for (g, row) in rows.iter_mut().enumerate().take(group) {
                    let at = seg.t0 * q_dim + (kv_head * group + g) * hd;
                    // SAFETY: the (split slot, head, partition) row belongs to this task alone.
                    let out = unsafe { split_out.slice((first_row + g * max_parts) * hd, hd) };
                    *row = QueryRow { q: &q[at..at + hd], from: first_position(seg.start), len: seg.start + 1, out };
                }
                let mut stats = [PartialStats::EMPTY; MAX_ROWS];
                let offset = kv.head_offset(index, kv_head);
                kernels::paged::attention_rows_partition(
                    &mut rows[..group],
                    keys,
                    values,
                    blocks,
                    offset,
                    scores,
                    part,
                    &mut stats,
                );
                for (g, st) in stats.iter().enumerate().take(group) {
                    // SAFETY: as above.
                    unsafe { states.slice(first_row + g * max_parts, 1)[0] = *st };
                }
                return;
            }
            // The segment's tokens from `first_token` on get outputs, from output row
            // `out_row0` on.
            let (first_token, out_row0, out_count) = outputs.span(&seg);
            let rows_total = out_count * group;
            let (kv_head, chunk) = (local / chunks(&seg), local % chunks(&seg));
            let (row0, row_end) = (chunk * MAX_ROWS, ((chunk + 1) * MAX_ROWS).min(rows_total));
            let offset = kv.head_offset(index, kv_head);
            let mut first = row0;
            while first < row_end {
                let count = MAX_ROWS.min(row_end - first);
                let mut sinks = [0.0f32; MAX_ROWS];
                for (slot, row) in rows.iter_mut().enumerate().take(count) {
                    let (k, head) = ((first + slot) / group, kv_head * group + (first + slot) % group);
                    if let Some(s) = &layer.sinks {
                        sinks[slot] = s[head];
                    }
                    let t = first_token + k;
                    let token = seg.t0 + t;
                    let at = token * q_dim + head * hd;
                    // SAFETY: the (output row, head) block of attn belongs to this task's
                    // segment, KV head group and row range, which no other task touches, and
                    // each slot of this call is a different row.
                    let out = unsafe { attn.slice((out_row0 + k) * q_dim + head * hd, hd) };
                    let pos = seg.start + t;
                    // Causal, unless the plan lets the token see further (an image's tokens;
                    // Gemma 4's on sliding layers only).
                    let len = match plan.attend_until.get(token) {
                        Some(&end) if window.is_some() || !plan.attend_until_sliding_only => end as usize,
                        _ => pos + 1,
                    };
                    *row = QueryRow { q: &q[at..at + hd], from: first_position(pos), len, out };
                }
                match &layer.sinks {
                    Some(_) => kernels::paged::attention_rows_sinks(
                        &mut rows[..count],
                        keys,
                        values,
                        blocks,
                        offset,
                        scores,
                        &sinks[..count],
                    ),
                    None => kernels::paged::attention_rows(&mut rows[..count], keys, values, blocks, offset, scores),
                }
                first += count;
            }
        });
        // The split segments' partitions folded in order into attn.
        if split_wanted {
            for (slot, seg) in segments.iter().filter(|seg| is_split(seg)).enumerate() {
                let np = parts(seg);
                let out_row = outputs.span(seg).1;
                for head in 0..n_heads {
                    let row = (slot * n_heads + head) * max_parts;
                    let at = out_row * q_dim + head * hd;
                    let (stats, parts_out) =
                        (&s.split_stats[row..row + np], &s.split_outputs[row * hd..(row + np) * hd]);
                    match &layer.sinks {
                        Some(sinks) => kernels::paged::merge_partitions_sink(
                            kv.layout,
                            stats,
                            parts_out,
                            sinks[head],
                            &mut s.attn[at..at + hd],
                        ),
                        None => kernels::paged::merge_partitions(kv.layout, stats, parts_out, &mut s.attn[at..at + hd]),
                    }
                }
            }
        }

        // 4. A gated layer's output: attn (rows, heads, head_dim) *= sigmoid(gate) element-wise,
        //    each output row by its token's gate.
        if layer.output_gate {
            for seg in segments {
                let (first_token, row0, count) = outputs.span(seg);
                for k in 0..count {
                    let (t, r) = (seg.t0 + first_token + k, row0 + k);
                    for head in 0..c.n_heads {
                        let gate = &s.q_gate[t * 2 * q_dim + head * 2 * hd + hd..t * 2 * q_dim + (head + 1) * 2 * hd];
                        let out = &mut s.attn[r * q_dim + head * hd..r * q_dim + (head + 1) * hd];
                        for (o, &g) in out.iter_mut().zip(gate) {
                            *o *= kylin_kernels::delta::sigmoid(g);
                        }
                    }
                }
            }
        }

        // 5. Output projection: attn (rows, n_heads * head_dim) -> proj (rows, hidden).
        let rows = outputs.rows(plan, n);
        if rows > 0 {
            layer.o_proj.forward(mm, &s.attn[..rows * q_dim], rows, &mut s.proj[..rows * h], &mut s.products);
        }
    }
}

/// Most segments of one step whose decode attention is split across threads by partition
/// (split-K is only wanted when a step has few attention tasks, so few segments).
pub(super) const SPLIT_SEGMENTS: usize = 8;
