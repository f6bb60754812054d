//! Gated DeltaNet, the linear attention of Qwen3.5 and Qwen3-Next (`linear_attn.*`):
//! projections, a causal depthwise convolution with SiLU, L2-normalised queries and keys, the
//! gated delta rule over a fixed-size state per sequence, a gated RMSNorm and the output
//! projection.
//!
//! Qwen3-Next stores its input projections fused and grouped per key head (`in_proj_qkvz`,
//! `in_proj_ba`; [`Projections::Grouped`]). They are bound as stored (zero copy), each run as
//! one product, and their output columns gathered into Qwen3.5's layout before the
//! convolution: a copy of `2 · key_dim + 2 · value_dim + 2 · value_heads` floats per token
//! (12 352 at Qwen3-Next-80B's sizes, against the products' 12 352 · hidden multiply-adds),
//! where gathering the matrices' rows at load time would hold owned copies of the weights in
//! place of views of the map, and could not reorder a quantized or published matrix's rows
//! without decoding it.
//!
//! Guarantees: every shape is checked in [`DeltaNet::new`]; [`DeltaNet::forward`] allocates
//! nothing and gives each token the same bits whatever else is in the batch and however its
//! sequence was split into steps (the delta rule runs in chunks aligned to absolute positions,
//! `kylin_kernels::delta`; the convolution continues from the sequence's own rows).

use kylin_kernels::delta::{self, DeltaDims, DeltaState, DeltaTokens};
use kylin_kernels::{self as kernels, WeightDType, WeightMatrix};
use kylin_loader::arch::Role;
use kylin_loader::family::{LinearAttention, NormKind};
use kylin_loader::{KylinError, LayerWeights, ModelWeights, Result, WeightTensor};

use super::linear::{Linear, Norm, Vector, shape_error, weight_dtype};
use super::scratch::Scratch;
use super::{BatchPlan, Step};
use crate::shared_mut::SharedMut;
use crate::state_pool::{RecurrentShape, StatePool};

/// The input projections, as the checkpoint stores them (one per layer, built once at load:
/// the variants' difference in size does not matter).
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Projections {
    /// Qwen3.5's four matrices.
    Split {
        /// `[2 · key_dim + value_dim, hidden]`: queries, keys and values before the convolution.
        qkv: Linear,
        /// `[value_dim, hidden]`: the output gate.
        z: Linear,
        /// `[value_heads, hidden]`: the write strength `β` (before its sigmoid) and the decay's
        /// input.
        b: Linear,
        a: Linear,
    },
    /// Qwen3-Next's two, rows grouped per key head `g` (`r` value heads per key head):
    /// `qkvz` `[key_heads · (2 · key_head_dim + 2 · r · value_head_dim), hidden]`, group `g`'s
    /// rows its query, its key, its `r` heads' values and their gates `z`; `ba`
    /// `[key_heads · 2 · r, hidden]`, group `g`'s rows its `r` heads' `b` then their `a`.
    Grouped { qkvz: Linear, ba: Linear },
}

/// One layer's Gated DeltaNet, with its index among the model's recurrent layers.
#[derive(Debug, Clone)]
pub(super) struct DeltaNet {
    projections: Projections,
    /// `[conv_dim, 1, kernel]`, read in its stored dtype.
    conv: WeightTensor,
    conv_dtype: WeightDType,
    /// `[value_heads]`: `A_log` and `dt_bias` of the decay `g = -exp(A_log) · softplus(a + dt_bias)`.
    a_log: Vector,
    dt_bias: Vector,
    /// `[value_head_dim]`: the gated RMSNorm's weight (plain `w`, not `1 + w`).
    norm: Norm,
    /// `[hidden, value_dim]`.
    out_proj: Linear,
    dims: LinearAttention,
    /// The layer's index among the model's recurrent layers (its place in the state pool).
    pub(super) state: usize,
}

impl DeltaNet {
    /// Binds layer `index`'s Gated DeltaNet, checking every shape.
    pub(super) fn new(
        w: &LayerWeights,
        index: usize,
        hidden: usize,
        dims: LinearAttention,
        state: usize,
        weights: &ModelWeights,
    ) -> Result<Self> {
        if dims.key_head_dim > delta::MAX_DIM || dims.value_head_dim > delta::MAX_DIM {
            return Err(KylinError::operator_unsupported(format!(
                "layer {index}: linear-attention heads of {} and {} are wider than the kernels' {}",
                dims.key_head_dim,
                dims.value_head_dim,
                delta::MAX_DIM
            )));
        }
        if dims.conv_kernel == 0 || dims.conv_kernel > delta::MAX_CONV_KERNEL {
            return Err(KylinError::operator_unsupported(format!(
                "layer {index}: a convolution of {} taps is outside the kernels' 1..={}",
                dims.conv_kernel,
                delta::MAX_CONV_KERNEL
            )));
        }
        let (conv_dim, value_dim) = (dims.conv_dim(), dims.value_dim());
        let linear = |role: Role, rows: usize, cols: usize| -> Result<Linear> {
            Linear::bind(w.require(role, index)?, None, rows, cols, weights)
        };
        let conv = w.require(Role::LinearConv, index)?;
        if conv.shape != [conv_dim, 1, dims.conv_kernel] {
            return Err(shape_error(conv, &[conv_dim, 1, dims.conv_kernel]));
        }
        let projections = if dims.grouped_projections {
            Projections::Grouped {
                qkvz: linear(Role::LinearQkvzProj, conv_dim + value_dim, hidden)?,
                ba: linear(Role::LinearBaProj, 2 * dims.value_heads, hidden)?,
            }
        } else {
            Projections::Split {
                qkv: linear(Role::LinearQkvProj, conv_dim, hidden)?,
                z: linear(Role::LinearZProj, value_dim, hidden)?,
                b: linear(Role::LinearBProj, dims.value_heads, hidden)?,
                a: linear(Role::LinearAProj, dims.value_heads, hidden)?,
            }
        };
        Ok(DeltaNet {
            projections,
            conv_dtype: weight_dtype(conv)?,
            conv: conv.clone(),
            a_log: Vector::new(w.require(Role::LinearALog, index)?, dims.value_heads)?,
            dt_bias: Vector::new(w.require(Role::LinearDtBias, index)?, dims.value_heads)?,
            norm: Norm::new(w.require(Role::LinearNorm, index)?, dims.value_head_dim, NormKind::Rms)?,
            out_proj: linear(Role::LinearOutProj, hidden, value_dim)?,
            dims,
            state,
        })
    }

    /// The state it keeps per sequence.
    pub(super) fn shape(&self) -> RecurrentShape {
        let d = &self.dims;
        RecurrentShape::DeltaNet {
            heads: d.value_heads,
            dk: d.key_head_dim,
            dv: d.value_head_dim,
            channels: d.conv_dim(),
            taps: d.conv_kernel,
        }
    }

    /// The projections with their roles: in_proj_qkv, z, b, a (or in_proj_qkvz, ba), then
    /// out_proj.
    pub(super) fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        let inputs = match &self.projections {
            Projections::Split { qkv, z, b, a } => [
                Some((Role::LinearQkvProj, qkv)),
                Some((Role::LinearZProj, z)),
                Some((Role::LinearBProj, b)),
                Some((Role::LinearAProj, a)),
            ],
            Projections::Grouped { qkvz, ba } => {
                [Some((Role::LinearQkvzProj, qkvz)), Some((Role::LinearBaProj, ba)), None, None]
            }
        };
        inputs.into_iter().flatten().chain(std::iter::once((Role::LinearOutProj, &self.out_proj)))
    }

    pub(super) fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        let inputs = match &mut self.projections {
            Projections::Split { qkv, z, b, a } => [Some(qkv), Some(z), Some(b), Some(a)],
            Projections::Grouped { qkvz, ba } => [Some(qkvz), Some(ba), None, None],
        };
        inputs.into_iter().flatten().chain(std::iter::once(&mut self.out_proj))
    }

    /// Floats per token of the grouped projections' outputs before they are gathered (0 for
    /// the split ones): `(conv_dim + value_dim) + 2 · value_heads`.
    pub(super) fn grouped_width(&self) -> usize {
        match self.projections {
            Projections::Grouped { .. } => self.dims.conv_dim() + self.dims.value_dim() + 2 * self.dims.value_heads,
            Projections::Split { .. } => 0,
        }
    }

    /// The vectors it reads (for parameter counts): `A_log`, `dt_bias`, the norm's weight.
    pub(super) fn vectors(&self) -> impl Iterator<Item = &Vector> {
        [&self.a_log, &self.dt_bias, &self.norm.weight].into_iter()
    }

    /// Bytes and elements of the convolution's weight.
    pub(super) fn conv_tensor(&self) -> &WeightTensor {
        &self.conv
    }

    /// `proj (n, hidden)` for every segment of the batch, each continuing its sequence's state
    /// in its live slot of `states`; the input is `xn` (`normed`) or the residual stream `x`.
    pub(super) fn forward(
        &self,
        c: &Step<'_>,
        states: &mut StatePool,
        s: &mut Scratch,
        plan: &BatchPlan,
        normed: bool,
    ) {
        let d = &self.dims;
        let n = plan.tokens();
        let h = c.hidden;
        let (cd, kd, vd) = (d.conv_dim(), d.key_dim(), d.value_dim());
        let (hk, hv, dk, dv) = (d.key_heads, d.value_heads, d.key_head_dim, d.value_head_dim);
        let chunk = states.chunk();
        let input = if normed { &s.xn[..n * h] } else { &s.x[..n * h] };

        // 1. Projections over all tokens: input (n, hidden) -> qkv (n, conv_dim), z (n, value_dim),
        //    b and a (n, value_heads).
        let (b_out, a_out) = s.lin_gates[..2 * n * hv].split_at_mut(n * hv);
        match &self.projections {
            Projections::Split { qkv, z, b, a } => Linear::forward_many(
                c.mm,
                input,
                n,
                [(qkv, &mut s.lin_in[..n * cd]), (z, &mut s.lin_z[..n * vd]), (b, b_out), (a, a_out)],
                &mut s.products,
            ),
            Projections::Grouped { qkvz, ba } => {
                // qkvz (n, conv_dim + value_dim) and ba (n, 2 · value_heads), grouped per key
                // head, then gathered per token into qkv, z, b and a.
                let (qw, bw) = (cd + vd, 2 * hv);
                let (fused_qkvz, fused_ba) = s.lin_grouped[..n * (qw + bw)].split_at_mut(n * qw);
                Linear::forward_many(c.mm, input, n, [(qkvz, &mut *fused_qkvz), (ba, &mut *fused_ba)], &mut s.products);
                let r = hv / hk;
                let group = 2 * dk + 2 * r * dv;
                for t in 0..n {
                    let src = &fused_qkvz[t * qw..(t + 1) * qw];
                    let qkv = &mut s.lin_in[t * cd..(t + 1) * cd];
                    let z = &mut s.lin_z[t * vd..(t + 1) * vd];
                    for (g, part) in src.chunks_exact(group).enumerate() {
                        let (q, rest) = part.split_at(dk);
                        let (k, rest) = rest.split_at(dk);
                        let (v, zg) = rest.split_at(r * dv);
                        qkv[g * dk..(g + 1) * dk].copy_from_slice(q);
                        qkv[kd + g * dk..kd + (g + 1) * dk].copy_from_slice(k);
                        qkv[2 * kd + g * r * dv..2 * kd + (g + 1) * r * dv].copy_from_slice(v);
                        z[g * r * dv..(g + 1) * r * dv].copy_from_slice(zg);
                    }
                    let src = &fused_ba[t * bw..(t + 1) * bw];
                    for (g, part) in src.chunks_exact(2 * r).enumerate() {
                        b_out[t * hv + g * r..t * hv + (g + 1) * r].copy_from_slice(&part[..r]);
                        a_out[t * hv + g * r..t * hv + (g + 1) * r].copy_from_slice(&part[r..]);
                    }
                }
            }
        }

        // 2. The causal convolution and SiLU, per segment over its sequence's last rows:
        //    qkv (n, conv_dim) -> mixed (n, conv_dim). The rows at the last chunk boundary the
        //    segment reaches become the slot's anchor.
        let layout = *states.layer(self.state);
        let stride = states.live_stride();
        let conv = WeightMatrix { dtype: self.conv_dtype, rows: cd, cols: d.conv_kernel, data: self.conv.bytes() };
        convolve_segments(plan, states, self.state, conv, None, true, &s.lin_in, &mut s.lin_mixed);

        // 3. Per token: q and k L2-normalised per key head, q scaled by dk^-½; per value head
        //    β = sigmoid(b) and g = -exp(A_log) · softplus(a + dt_bias), side by side in
        //    gates (n, 2 · value_heads).
        let scale = (dk as f32).powf(-0.5);
        for t in 0..n {
            let row = &mut s.lin_mixed[t * cd..t * cd + 2 * kd];
            for (i, head) in row.chunks_exact_mut(dk).enumerate() {
                delta::l2_normalize(head, 1e-6);
                if i < hk {
                    kernels::scale(head, scale);
                }
            }
        }
        let (a_log, dt_bias) = (self.a_log.view(), self.dt_bias.view());
        for t in 0..n {
            for head in 0..hv {
                let b = s.lin_gates[t * hv + head];
                let a = s.lin_gates[n * hv + t * hv + head];
                s.lin_beta[t * 2 * hv + head] = delta::sigmoid(b);
                s.lin_beta[t * 2 * hv + hv + head] = -a_log.get(head).exp() * delta::softplus(a + dt_bias.get(head));
            }
        }

        // 4. The delta rule: one pool task per (segment, value head), in chunks aligned to the
        //    sequence's positions, into core (value_heads, n, dv), head-major so each task
        //    writes one contiguous range.
        let group = hv / hk;
        let dims = DeltaDims { dk, dv, chunk };
        let mixed = &s.lin_mixed[..n * cd];
        let gates = &s.lin_beta[..n * 2 * hv];
        let core = SharedMut::new(&mut s.lin_core[..n * vd]);
        let live = SharedMut::new(states.live_mut());
        let segments = &plan.segments;
        c.mm.pool.run(segments.len() * hv, &|task| {
            let (seg, head) = (segments[task / hv], task % hv);
            let key_head = head / group;
            let base = seg.state as usize * stride;
            let t0 = seg.t0;
            let tokens = DeltaTokens {
                n: seg.n,
                q: &mixed[t0 * cd + key_head * dk..],
                k: &mixed[t0 * cd + kd + key_head * dk..],
                v: &mixed[t0 * cd + 2 * kd + head * dv..],
                qkv_stride: cd,
                g: &gates[t0 * 2 * hv + hv + head..],
                beta: &gates[t0 * 2 * hv + head..],
                gate_stride: 2 * hv,
            };
            // SAFETY: each task owns one (slot, head) of the layer's state (a sequence appears
            // once per plan, so slots differ between segments) and one (head, segment) range
            // of core; no two tasks form overlapping slices.
            let (state_s, keys, values, decay, out) = unsafe {
                (
                    live.slice(base + layout.state + head * dk * dv, dk * dv),
                    live.slice(base + layout.keys + head * chunk * dk, chunk * dk),
                    live.slice(base + layout.values + head * chunk * dv, chunk * dv),
                    live.slice(base + layout.decay + head * chunk, chunk),
                    core.slice((head * n + t0) * dv, seg.n * dv),
                )
            };
            let mut state = DeltaState { s: state_s, keys, values, decay };
            delta::delta_rule(dims, seg.start, &tokens, &mut state, out);
        });

        // 5. The gated RMSNorm per (token, value head): rmsnorm(o) · w · silu(z), into z's rows
        //    (n, value_dim); then out_proj: (n, value_dim) -> proj (n, hidden).
        for t in 0..n {
            for head in 0..hv {
                let o = &s.lin_core[(head * n + t) * dv..(head * n + t + 1) * dv];
                self.norm.apply(o, c.eps, &mut s.lin_tmp[..dv]);
                let z = &mut s.lin_z[t * vd + head * dv..t * vd + (head + 1) * dv];
                kernels::silu_mul(z, &s.lin_tmp[..dv]);
            }
        }
        self.out_proj.forward(c.mm, &s.lin_z[..n * vd], n, &mut s.proj[..n * h], &mut s.products);
    }
}

/// The causal depthwise convolution of a recurrent layer (Gated DeltaNet's, LFM2's), per
/// segment over its sequence's rolling rows in the state pool: `input` `(n, width)` ->
/// `output` `(n, width)`, `width = conv.rows`, optionally plus `bias` and through SiLU. The rows
/// at the last chunk boundary a segment reaches become its slot's anchor. A speculative
/// segment's rows are logged first, for [`StatePool::roll_back`].
#[allow(clippy::too_many_arguments)]
pub(super) fn convolve_segments(
    plan: &BatchPlan,
    states: &mut StatePool,
    state_layer: usize,
    conv: WeightMatrix<'_>,
    bias: Option<kernels::WeightVector<'_>>,
    silu: bool,
    input: &[f32],
    output: &mut [f32],
) {
    let width = conv.rows;
    let layout = *states.layer(state_layer);
    let stride = states.live_stride();
    let chunk = states.chunk();
    let conv_len = width * (conv.cols - 1);
    let log_rows = states.speculative_rows();
    for seg in &plan.segments {
        let base = seg.state as usize * stride;
        let (t0, t1) = (seg.t0 * width, (seg.t0 + seg.n) * width);
        if let Some(from) = seg.log_from {
            // The log: the rows before position `from`, then the input rows of the positions
            // from there, (taps - 1 + rows, width); this segment's go at `seg.start - from`.
            let logged = seg.start + seg.n;
            assert!(
                from <= seg.start && logged - from <= log_rows,
                "a segment logging positions {from}..{logged}; the logs hold {log_rows}"
            );
            let live = states.live_mut();
            let log = base + layout.conv_log;
            if seg.start == from {
                live.copy_within(base + layout.conv..base + layout.conv + conv_len, log);
            }
            let at = log + conv_len + (seg.start - from) * width;
            live[at..at + seg.n * width].copy_from_slice(&input[t0..t1]);
        }
        let live = states.live_mut();
        let (before, after) = live.split_at_mut(base + layout.conv_anchor);
        let rows = &mut before[base + layout.conv..base + layout.conv + conv_len];
        let anchor = &mut after[..conv_len];
        let boundary = (seg.start + seg.n) / chunk * chunk;
        let anchor = (boundary > seg.start).then(|| (boundary - seg.start, anchor));
        delta::causal_conv1d(&input[t0..t1], seg.n, width, conv, bias, silu, rows, anchor, &mut output[t0..t1]);
    }
}
