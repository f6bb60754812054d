//! The Mixture-of-Experts feed-forward block every MoE family runs: a router picks each token's
//! experts and weights, the tokens are grouped by expert so that one expert's weights are read
//! once for all the tokens routed to it, and each token's output is the weighted sum of its
//! experts' outputs.
//!
//! Guarantees:
//! - The router, the top-k choice and the weights follow transformers' arithmetic per family
//!   (`Routing`), in f32.
//! - Every expert is a pair of [`Linear`] layers over the stored weights (views into the map:
//!   zero copy), quantized like any other linear layer under `--quantize`; an expert no token
//!   is routed to is never read, so resident memory follows the experts in use.
//! - Batch invariance: an expert's product gives each token's row the same bits whatever other
//!   tokens share it (the kernels' guarantee), and a token's experts are summed in the order of
//!   their indices, as transformers' `index_add_` loop does; so a token's output does not depend
//!   on its batch.
//! - Nothing is allocated per step: the routing tables and gathered activations live in
//!   [`MoeScratch`], planned from the batch limits.

use kylin_kernels::{self as kernels};
use kylin_loader::arch::Role;
use kylin_loader::family::{ExpertActivation, MAX_EXPERT_GROUPS, MoeSpec, Routing};
use kylin_loader::{DType, KylinError, LayerWeights, ModelWeights, Result, WeightTensor};

use super::Step;
use super::linear::{Linear, Norm, Vector};
use super::scratch::ProductScratch;

/// One routed expert: `down(act(gate(x)) · up(x))`, gate and up `[width, hidden]` each (or
/// interleaved by row in one `[2 · width, hidden]` matrix), down `[hidden, width]`.
#[derive(Debug, Clone)]
pub(super) struct Expert {
    pub(super) gate_up: GateUp,
    pub(super) down: Linear,
}

/// An expert's gate and up projections. The variants differ in size (two matrices or one), and
/// the experts live in one `Vec` built once at load: boxing would add a pointer chase per
/// expert to every step for no memory that matters.
#[derive(Debug, Clone)]
#[allow(clippy::large_enum_variant)]
pub(super) enum GateUp {
    /// Two matrices (views of a stacked tensor's halves where it is stacked).
    Split { gate: Linear, up: Linear },
    /// One matrix whose even rows are the gate and odd rows the up projection (gpt-oss's
    /// published MXFP4 layout); the activation reads them pairwise.
    Interleaved(Linear),
}

/// Qwen2-MoE's shared expert: a gated MLP whose output is multiplied by
/// `sigmoid(gate(x))` and added to the routed experts'.
#[derive(Debug, Clone)]
pub(super) struct SharedExpert {
    pub(super) expert: Expert,
    /// `[1, hidden]`: the output is times `sigmoid(gate(x))` (Qwen2-MoE); GLM-4.5 has none.
    gate: Option<Linear>,
}

/// The router and the experts of one layer.
#[derive(Debug, Clone)]
pub(super) struct Moe {
    /// `[experts, hidden]` (with a bias for gpt-oss).
    router: Linear,
    routing: Routing,
    /// Gemma 4: the router input's scale `(hidden)` and each expert's weight scale.
    router_scale: Option<Vec<f32>>,
    expert_scale: Option<Vec<f32>>,
    /// Gemma 4's unweighted RMSNorm of the router's input.
    router_norm: Option<Norm>,
    /// LFM2-MoE's `expert_bias` `(experts)`, added to the scores only to choose the experts.
    selection_bias: Option<Vec<f32>>,
    pub(super) experts: Vec<Expert>,
    pub(super) shared: Option<SharedExpert>,
    top_k: usize,
    width: usize,
    activation: ExpertActivation,
}

/// The routing tables and gathered activations of one step, sized for `max_tokens` tokens.
#[derive(Debug, Default)]
pub struct MoeScratch {
    /// Router logits, `(max_tokens, experts)`.
    logits: Vec<f32>,
    /// Gemma 4's normed and scaled router input, `(max_tokens, hidden)`.
    router_input: Vec<f32>,
    /// Each token's experts and weights, `(max_tokens, top_k)`, in increasing expert order.
    route_expert: Vec<u32>,
    route_weight: Vec<f32>,
    /// Entries (`token · top_k + slot`) grouped by expert; expert `e`'s are
    /// `order[start[e]..start[e + 1]]`; and each entry's place in that order.
    order: Vec<u32>,
    start: Vec<usize>,
    place: Vec<u32>,
    /// One expert's gathered inputs `(max_tokens, hidden)`, gate and up `(max_tokens, width)`.
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// Every entry's expert output, in grouped order, `(max_tokens · top_k, hidden)`.
    y: Vec<f32>,
    /// The shared expert's output `(max_tokens, hidden)` and gate `(max_tokens, 1)`.
    shared: Vec<f32>,
    shared_gate: Vec<f32>,
    /// Gemma 4's two branches: the experts' normed input and the MLP's normed output,
    /// `(max_tokens, hidden)` each.
    pub(super) branch_input: Vec<f32>,
    pub(super) branch_sum: Vec<f32>,
}

impl MoeScratch {
    /// Buffers for `max_tokens` tokens of a model whose MoE block is `spec` (empty without one).
    pub(super) fn plan(spec: Option<&MoeSpec>, max_tokens: usize, hidden: usize, gemma4: bool) -> Option<MoeScratch> {
        let Some(m) = spec else { return Some(MoeScratch::default()) };
        let entries = max_tokens.checked_mul(m.top_k)?;
        // Interleaved gate/up products (gpt-oss) fill `gate` with two columns per unit of width.
        let width = (2 * m.intermediate).max(m.shared_intermediate.unwrap_or(0));
        let sized = |rows: usize, cols: usize| rows.checked_mul(cols).map(|n| vec![0.0f32; n]);
        Some(MoeScratch {
            logits: sized(max_tokens, m.num_experts)?,
            router_input: if gemma4 { sized(max_tokens, hidden)? } else { Vec::new() },
            route_expert: vec![0; entries],
            route_weight: vec![0.0; entries],
            order: vec![0; entries],
            start: vec![0; m.num_experts + 1],
            place: vec![0; entries],
            x: sized(max_tokens, hidden)?,
            gate: sized(max_tokens, width)?,
            up: sized(max_tokens, width)?,
            y: sized(entries, hidden)?,
            shared: if m.shared_intermediate.is_some() { sized(max_tokens, hidden)? } else { Vec::new() },
            shared_gate: if m.shared_intermediate.is_some() { vec![0.0; max_tokens] } else { Vec::new() },
            branch_input: if gemma4 { sized(max_tokens, hidden)? } else { Vec::new() },
            branch_sum: if gemma4 { sized(max_tokens, hidden)? } else { Vec::new() },
        })
    }

    /// Elements of every buffer (f32 and u32 alike take four bytes).
    pub(super) fn elements(&self) -> usize {
        self.logits.len()
            + self.router_input.len()
            + self.route_expert.len()
            + self.route_weight.len()
            + self.order.len()
            + 2 * self.start.len()
            + self.place.len()
            + self.x.len()
            + self.gate.len()
            + self.up.len()
            + self.y.len()
            + self.shared.len()
            + self.shared_gate.len()
            + self.branch_input.len()
            + self.branch_sum.len()
    }

    /// The float buffers, to touch their pages at start-up.
    pub(super) fn buffers_mut(&mut self) -> [&mut Vec<f32>; 7] {
        [
            &mut self.logits,
            &mut self.x,
            &mut self.gate,
            &mut self.up,
            &mut self.y,
            &mut self.shared,
            &mut self.branch_sum,
        ]
    }
}

impl Expert {
    /// The matrices with their roles: gate and up (or the interleaved pair), then down.
    fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        let gate_up = match &self.gate_up {
            GateUp::Split { gate, up } => [Some((Role::ExpertGate, gate)), Some((Role::ExpertUp, up))],
            GateUp::Interleaved(m) => [Some((Role::ExpertGateUp, m)), None],
        };
        gate_up.into_iter().flatten().chain(std::iter::once((Role::ExpertDown, &self.down)))
    }

    fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        let gate_up = match &mut self.gate_up {
            GateUp::Split { gate, up } => [Some(gate), Some(up)],
            GateUp::Interleaved(m) => [Some(m), None],
        };
        gate_up.into_iter().flatten().chain(std::iter::once(&mut self.down))
    }

    fn split(gate: Linear, up: Linear, down: Linear) -> Expert {
        Expert { gate_up: GateUp::Split { gate, up }, down }
    }
}

impl Moe {
    /// Binds layer `index`'s router and experts (`spec`), checking every shape. Stacked
    /// experts arrive as per-expert views; gpt-oss's input-major BF16 experts are transposed
    /// and their interleaved gate and up rows separated here, into owned copies (an explicit
    /// exception to zero copy, for a layout that is not the published MXFP4 one).
    pub(super) fn new(
        w: &LayerWeights,
        index: usize,
        hidden: usize,
        spec: &MoeSpec,
        weights: &ModelWeights,
    ) -> Result<Self> {
        let width = spec.intermediate;
        let router =
            Linear::bind(w.require(Role::Router, index)?, w.get(Role::RouterBias), spec.num_experts, hidden, weights)?;
        let (router_scale, expert_scale, router_norm) = match spec.routing {
            Routing::Gemma4 => (
                Some(Vector::new(w.require(Role::RouterScale, index)?, hidden)?.values()),
                Some(Vector::new(w.require(Role::RouterExpertScale, index)?, spec.num_experts)?.values()),
                Some(Norm::unweighted(hidden)),
            ),
            _ => (None, None, None),
        };
        let selection_bias = match spec.routing {
            Routing::SigmoidTopK { selection_bias: true, .. } => {
                Some(Vector::new(w.require(Role::RouterSelectionBias, index)?, spec.num_experts)?.values())
            }
            _ => None,
        };
        if w.experts.len() != spec.num_experts {
            return Err(KylinError::tensor_missing(format!(
                "layer {index} has {} experts bound; the configuration has {}",
                w.experts.len(),
                spec.num_experts
            )));
        }
        let interleaved = matches!(spec.activation, ExpertActivation::ClampedSwiGlu { .. });
        let experts = (0..spec.num_experts)
            .map(|e| Self::expert(w, index, e, hidden, width, interleaved, weights))
            .collect::<Result<Vec<_>>>()?;
        let shared = match spec.shared_intermediate {
            Some(sw) => {
                let linear = |role: Role, rows: usize, cols: usize| -> Result<Linear> {
                    Linear::bind(w.require(role, index)?, None, rows, cols, weights)
                };
                Some(SharedExpert {
                    expert: Expert::split(
                        linear(Role::SharedGate, sw, hidden)?,
                        linear(Role::SharedUp, sw, hidden)?,
                        linear(Role::SharedDown, hidden, sw)?,
                    ),
                    gate: if spec.shared_gated { Some(linear(Role::SharedExpertGate, 1, hidden)?) } else { None },
                })
            }
            None => None,
        };
        Ok(Moe {
            router,
            routing: spec.routing,
            router_scale,
            expert_scale,
            router_norm,
            selection_bias,
            experts,
            shared,
            top_k: spec.top_k,
            width,
            activation: spec.activation,
        })
    }

    /// Expert `e` of layer `index`, from whichever layout the checkpoint has; a stacked
    /// gate/up matrix is `interleaved` by row (gpt-oss) or gate rows first.
    fn expert(
        w: &LayerWeights,
        index: usize,
        e: usize,
        hidden: usize,
        width: usize,
        interleaved: bool,
        weights: &ModelWeights,
    ) -> Result<Expert> {
        let tensors = &w.experts[e];
        let get = |role: Role| tensors.get(&role);
        let need = |role: Role| w.require_expert(e, role, index);
        if let Some(gate) = get(Role::ExpertGate) {
            // One tensor per expert and projection.
            return Ok(Expert::split(
                Linear::bind(gate, get(Role::ExpertGateBias), width, hidden, weights)?,
                Linear::bind(need(Role::ExpertUp)?, get(Role::ExpertUpBias), width, hidden, weights)?,
                Linear::bind(need(Role::ExpertDown)?, get(Role::ExpertDownBias), hidden, width, weights)?,
            ));
        }
        if let (Some(gate_up), true) = (get(Role::ExpertGateUp), interleaved) {
            // gpt-oss's `[2w, hidden]` with gate and up interleaved by row (MXFP4 as published).
            return Ok(Expert {
                gate_up: GateUp::Interleaved(Linear::bind(
                    gate_up,
                    get(Role::ExpertGateUpBias),
                    2 * width,
                    hidden,
                    weights,
                )?),
                down: Linear::bind(need(Role::ExpertDown)?, get(Role::ExpertDownBias), hidden, width, weights)?,
            });
        }
        if let Some(gate_up) = get(Role::ExpertGateUp) {
            // Stacked `[2w, hidden]`, gate rows first: two row views.
            let part = |r0: usize, what: &str| {
                gate_up.rows(r0, r0 + width, format!("{}.{what}", gate_up.name)).ok_or_else(|| {
                    KylinError::tensor_shape_mismatch(format!(
                        "tensor '{}' ({:?}) is not [2 * {width}, {hidden}]",
                        gate_up.name, gate_up.shape
                    ))
                })
            };
            let (gate, up) = (part(0, "gate")?, part(width, "up")?);
            return Ok(Expert::split(
                Linear::bind(&gate, None, width, hidden, weights)?,
                Linear::bind(&up, None, width, hidden, weights)?,
                Linear::bind(need(Role::ExpertDown)?, get(Role::ExpertDownBias), hidden, width, weights)?,
            ));
        }
        // gpt-oss's input-major BF16 layout: `[hidden, 2w]` with gate and up interleaved by
        // column, `[w, hidden]`, biases `[2w]` interleaved and `[hidden]`.
        let gate_up = need(Role::ExpertGateUpInputMajor)?;
        let down = need(Role::ExpertDownInputMajor)?;
        let gate_up_values = float_values(gate_up, &[hidden, 2 * width])?;
        let down_values = float_values(down, &[width, hidden])?;
        // (hidden, 2w) -> gate (w, hidden) from even columns, up (w, hidden) from odd ones.
        let mut gate = vec![0.0f32; width * hidden];
        let mut up = vec![0.0f32; width * hidden];
        for i in 0..hidden {
            for j in 0..width {
                gate[j * hidden + i] = gate_up_values[i * 2 * width + 2 * j];
                up[j * hidden + i] = gate_up_values[i * 2 * width + 2 * j + 1];
            }
        }
        // (w, hidden) -> (hidden, w).
        let mut down_t = vec![0.0f32; hidden * width];
        for j in 0..width {
            for i in 0..hidden {
                down_t[i * width + j] = down_values[j * hidden + i];
            }
        }
        let (gate_bias, up_bias) = match get(Role::ExpertGateUpBias) {
            Some(b) => {
                let v = float_values(b, &[2 * width])?;
                let even: Vec<f32> = v.iter().step_by(2).copied().collect();
                let odd: Vec<f32> = v.iter().skip(1).step_by(2).copied().collect();
                (
                    Some(owned(format!("{}.gate", b.name), b.dtype, vec![width], &even)?),
                    Some(owned(format!("{}.up", b.name), b.dtype, vec![width], &odd)?),
                )
            }
            None => (None, None),
        };
        let dtype = gate_up.dtype;
        let gate = owned(format!("{}.gate", gate_up.name), dtype, vec![width, hidden], &gate)?;
        let up = owned(format!("{}.up", gate_up.name), dtype, vec![width, hidden], &up)?;
        let down_t = owned(format!("{}.t", down.name), down.dtype, vec![hidden, width], &down_t)?;
        Ok(Expert::split(
            Linear::bind(&gate, gate_bias.as_ref(), width, hidden, weights)?,
            Linear::bind(&up, up_bias.as_ref(), width, hidden, weights)?,
            Linear::bind(&down_t, get(Role::ExpertDownBias), hidden, width, weights)?,
        ))
    }

    /// The experts' and the shared expert's matrices with their roles (the router stays as
    /// stored).
    pub(super) fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        let routed = self.experts.iter().flat_map(Expert::linears);
        let shared = self.shared.iter().flat_map(|s| {
            s.expert.linears().map(|(role, m)| {
                let role = match role {
                    Role::ExpertGate => Role::SharedGate,
                    Role::ExpertUp => Role::SharedUp,
                    _ => Role::SharedDown,
                };
                (role, m)
            })
        });
        routed.chain(shared)
    }

    pub(super) fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        let routed = self.experts.iter_mut().flat_map(|x| x.linears_mut());
        let shared = self.shared.iter_mut().flat_map(|s| s.expert.linears_mut());
        routed.chain(shared)
    }

    /// The router and the shared expert's gate, which stay in their stored dtype.
    pub(super) fn side_linears(&self) -> impl Iterator<Item = &Linear> {
        std::iter::once(&self.router).chain(self.shared.iter().filter_map(|s| s.gate.as_ref()))
    }

    /// Bytes of every expert, the shared expert and the router.
    pub(super) fn bytes_resident(&self) -> u64 {
        let all: u64 = self.experts.iter().flat_map(Expert::linears).map(|(_, m)| m.byte_len()).sum();
        let shared: u64 = self.shared.iter().flat_map(|s| s.expert.linears()).map(|(_, m)| m.byte_len()).sum();
        all + shared + self.side_linears().map(Linear::byte_len).sum::<u64>()
    }

    /// Bytes one token reads: the router, `top_k` experts (their average size) and the shared
    /// expert.
    pub(super) fn bytes_per_token(&self) -> u64 {
        let all: u64 = self.experts.iter().flat_map(Expert::linears).map(|(_, m)| m.byte_len()).sum();
        let routed = all * self.top_k as u64 / self.experts.len().max(1) as u64;
        let shared: u64 = self.shared.iter().flat_map(|s| s.expert.linears()).map(|(_, m)| m.byte_len()).sum();
        routed + shared + self.side_linears().map(Linear::byte_len).sum::<u64>()
    }

    /// `out (n, hidden) = Σ_e w_e · expert_e(x)` over each token's routed experts (plus the
    /// shared expert), with the router reading `router_x` (`x` itself but for Gemma 4, which
    /// routes from the layer's un-normed input).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward(
        &self,
        c: &Step<'_>,
        x: &[f32],
        router_x: &[f32],
        n: usize,
        out: &mut [f32],
        ms: &mut MoeScratch,
        p: &mut ProductScratch,
    ) {
        let h = c.hidden;
        let (k, e_count, w) = (self.top_k, self.experts.len(), self.width);

        // 1. Router logits: router_x (n, hidden) -> logits (n, experts); Gemma 4 first normalises
        //    its input (no weight) and scales it by `scale · hidden^-0.5`.
        let logits = &mut ms.logits[..n * e_count];
        match (&self.router_norm, &self.router_scale) {
            (Some(norm), Some(scale)) => {
                let root = (h as f64).powf(-0.5) as f32;
                let input = &mut ms.router_input[..n * h];
                norm.rows(c.mm.pool, &router_x[..n * h], h, c.eps, input);
                for row in input.chunks_exact_mut(h) {
                    for (v, &s) in row.iter_mut().zip(scale) {
                        *v = *v * s * root;
                    }
                }
                self.router.forward(c.mm, input, n, logits, p);
            }
            _ => self.router.forward(c.mm, &router_x[..n * h], n, logits, p),
        }

        // 2. Each token's top k experts and their weights, then sorted by expert index (the
        //    order their outputs are summed in).
        for t in 0..n {
            let row = &mut logits[t * e_count..(t + 1) * e_count];
            let experts = &mut ms.route_expert[t * k..(t + 1) * k];
            let weights = &mut ms.route_weight[t * k..(t + 1) * k];
            let tables =
                Tables { expert_scale: self.expert_scale.as_deref(), selection_bias: self.selection_bias.as_deref() };
            route(self.routing, row, experts, weights, tables);
            sort_by_expert(experts, weights);
        }

        // 3. Entries grouped by expert (a counting sort): expert e's entries are
        //    order[start[e]..start[e + 1]], in token order.
        let entries = n * k;
        let start = &mut ms.start[..e_count + 1];
        start.fill(0);
        for &e in &ms.route_expert[..entries] {
            start[e as usize + 1] += 1;
        }
        for e in 0..e_count {
            start[e + 1] += start[e];
        }
        for (entry, &e) in ms.route_expert[..entries].iter().enumerate() {
            // `start[e]` is advanced as entries are placed, then restored below.
            let at = start[e as usize];
            ms.order[at] = entry as u32;
            ms.place[entry] = at as u32;
            start[e as usize] += 1;
        }
        for e in (1..=e_count).rev() {
            start[e] = start[e - 1];
        }
        start[0] = 0;

        // 4a. One token (a decode step of one sequence): its k experts' products run as
        //     grouped products, one pool dispatch per eight matrices instead of one per matrix,
        //     where their formats allow (each output row has the same bits as in 4: the
        //     products' canonical order does not depend on what else is in a dispatch).
        // 4. Each expert with tokens: gather their rows x (c, hidden); gate and up (c, width);
        //    the activation; down (c, width) -> y rows start[e]..start[e + 1] (c, hidden).
        if !(n == 1 && self.one_token_grouped(c, &x[..h], ms, p)) {
            for (e, expert) in self.experts.iter().enumerate() {
                let (s0, s1) = (ms.start[e], ms.start[e + 1]);
                let count = s1 - s0;
                if count == 0 {
                    continue;
                }
                for (i, &entry) in ms.order[s0..s1].iter().enumerate() {
                    let t = entry as usize / k;
                    ms.x[i * h..(i + 1) * h].copy_from_slice(&x[t * h..(t + 1) * h]);
                }
                run_expert(
                    c,
                    expert,
                    self.activation,
                    &ms.x[..count * h],
                    count,
                    w,
                    &mut ms.gate,
                    &mut ms.up,
                    &mut ms.y[s0 * h..s1 * h],
                    p,
                );
            }
        }

        // 5. out[t] = Σ w · y over the token's entries in expert order: the first product, then
        //    each further product rounded and added (transformers' `index_add_` of `y · w` into
        //    zeros).
        for t in 0..n {
            let row = &mut out[t * h..(t + 1) * h];
            for slot in 0..k {
                let entry = t * k + slot;
                let weight = ms.route_weight[entry];
                let y = &ms.y[ms.place[entry] as usize * h..(ms.place[entry] as usize + 1) * h];
                if slot == 0 {
                    for (o, &v) in row.iter_mut().zip(y) {
                        *o = v * weight;
                    }
                } else {
                    kernels::add_scaled(row, y, weight);
                }
            }
        }

        // 6. The shared expert: out += sigmoid(gate(x)) · shared(x) (Qwen2-MoE), or
        // out += shared(x) without a gate (GLM-4.5).
        if let Some(shared) = &self.shared {
            let sw = shared.expert.down.cols;
            run_expert(
                c,
                &shared.expert,
                ExpertActivation::Silu,
                &x[..n * h],
                n,
                sw,
                &mut ms.gate,
                &mut ms.up,
                &mut ms.shared[..n * h],
                p,
            );
            match &shared.gate {
                Some(gate) => {
                    gate.forward(c.mm, &x[..n * h], n, &mut ms.shared_gate[..n], p);
                    for t in 0..n {
                        let g = 1.0 / (1.0 + (-ms.shared_gate[t]).exp());
                        let row = &mut out[t * h..(t + 1) * h];
                        for (o, &v) in row.iter_mut().zip(&ms.shared[t * h..(t + 1) * h]) {
                            *o += g * v;
                        }
                    }
                }
                None => {
                    for (o, &v) in out[..n * h].iter_mut().zip(&ms.shared[..n * h]) {
                        *o += v;
                    }
                }
            }
        }
    }

    /// Step 4a of [`Moe::forward`], one token `x (1, hidden)` through its routed experts
    /// (the i-th one's outputs in row i of `ms.gate`, `ms.up` and `ms.y`): gate and up
    /// `(1, width)` each as grouped products over the one row `x`, the activation, then the
    /// downs `(1, width) -> (1, hidden)`, as grouped products each over its own expert's row
    /// when they are quantized or run in f32. `false`, with nothing written, unless every
    /// expert's gate and up are split, bias-free, without input quantization, and all quantized,
    /// all BF16 products (`--precision bf16`, the default for BF16 weights where the CPU has
    /// BF16 kernels) or all f32 products over row-major float weights (AVX2, `--precision
    /// f32`), and the rows fit.
    fn one_token_grouped(&self, c: &Step<'_>, x: &[f32], ms: &mut MoeScratch, p: &mut ProductScratch) -> bool {
        let (w, h, k) = (self.width, c.hidden, self.top_k);
        let MoeScratch { route_expert, gate, up, y, .. } = ms;
        let experts = &route_expert[..k];
        let plain = |l: &Linear| l.bias.is_none() && l.input_quant.is_none();
        let quantized = |l: &Linear| plain(l) && l.quant_matrix().is_some();
        let bf16 = |l: &Linear| plain(l) && l.quant.is_none() && l.dtype == kernels::WeightDType::BF16;
        let gate_up = |e: u32| match &self.experts[e as usize].gate_up {
            GateUp::Split { gate, up } => Some((gate, up)),
            GateUp::Interleaved(_) => None,
        };
        let all = |test: &dyn Fn(&Linear) -> bool| {
            experts.iter().all(|&e| gate_up(e).is_some_and(|(g, u)| test(g) && test(u)))
        };
        let bf16_kernels = c.mm.bf16.filter(|_| all(&bf16));
        let grouped_quant = bf16_kernels.is_none() && all(&quantized);
        // f32 products over row-major float weights (AVX2 without AVX-512, `--precision f32`).
        let float = |l: &Linear| plain(l) && l.quant.is_none() && l.strips.is_none();
        let grouped_float = c.mm.bf16.is_none() && all(&float);
        if !(grouped_quant || grouped_float || bf16_kernels.is_some()) || k * w > gate.len().min(up.len()) {
            return false;
        }
        let pool = c.mm.pool;
        // 2k × (1, hidden) · (hidden, width)ᵀ -> (1, width): gate then up of each expert, in
        // routing order, all reading x.
        let pairs = experts.iter().map(|&e| gate_up(e).expect("checked above"));
        let outputs = gate.chunks_exact_mut(w).zip(up.chunks_exact_mut(w));
        if bf16_kernels.is_some() || grouped_float {
            let mut jobs = pairs.zip(outputs).flat_map(|((g, u), (gy, uy))| [(g.matrix(), gy), (u.matrix(), uy)]);
            match bf16_kernels {
                Some(kind) => {
                    in_eights(2 * k, &mut jobs, |jobs| kernels::matmul_many_bf16(pool, kind, x, 1, &mut p.xb, jobs))
                }
                None => in_eights(2 * k, &mut jobs, |jobs| kernels::matmul_many(pool, x, 1, jobs)),
            }
        } else {
            let mut jobs = pairs.zip(outputs).flat_map(|((g, u), (gy, uy))| {
                [(g.quant_matrix().expect("checked above"), gy), (u.quant_matrix().expect("checked above"), uy)]
            });
            in_eights(2 * k, &mut jobs, |jobs| kernels::quant::matmul_many_quant(pool, x, 1, &mut p.xq, jobs));
        }
        for (gate, up) in gate[..k * w].chunks_exact_mut(w).zip(up.chunks_exact(w)) {
            activate(self.activation, gate, up);
        }
        let acts = &gate[..k * w];
        let y = &mut y[..k * h];
        let downs_grouped = experts.iter().all(|&e| quantized(&self.experts[e as usize].down))
            && kernels::quant::quant_scratch_len(k, w) <= p.xq.len();
        if downs_grouped {
            // k × (1, width) · (width, hidden)ᵀ -> (1, hidden), expert i reading row i.
            let mut downs = experts.iter().zip(y.chunks_exact_mut(h)).enumerate().map(|(row, (&e, y))| {
                let matrix = self.experts[e as usize].down.quant_matrix().expect("checked above");
                (kernels::quant::RowInput { matrix, row }, y)
            });
            in_eights(k, &mut downs, |jobs| kernels::quant::matmul_rows_quant(pool, acts, &mut p.xq, jobs));
        } else if c.mm.bf16.is_none() && experts.iter().all(|&e| float(&self.experts[e as usize].down)) {
            // k × (1, width) · (width, hidden)ᵀ -> (1, hidden) in f32, expert i reading row i.
            let mut downs = experts.iter().zip(y.chunks_exact_mut(h)).enumerate().map(|(row, (&e, y))| {
                (kernels::FloatRowInput { matrix: self.experts[e as usize].down.matrix(), row }, y)
            });
            in_eights(k, &mut downs, |jobs| kernels::matmul_rows(pool, acts, jobs));
        } else {
            for ((&e, act), y) in experts.iter().zip(acts.chunks_exact(w)).zip(y.chunks_exact_mut(h)) {
                // (1, width) · (width, hidden)ᵀ -> (1, hidden)
                self.experts[e as usize].down.forward(c.mm, act, 1, y, p);
            }
        }
        true
    }
}

/// Runs `run` over the next `count` items of `jobs`, in fixed arrays of up to eight (the
/// grouped products' own limit per dispatch): nothing is allocated.
fn in_eights<J>(count: usize, jobs: &mut impl Iterator<Item = J>, mut run: impl FnMut(&mut [J])) {
    fn take<J, const N: usize>(jobs: &mut impl Iterator<Item = J>) -> [J; N] {
        std::array::from_fn(|_| jobs.next().expect("counted by the caller"))
    }
    let mut left = count;
    while left > 0 {
        let taken = left.min(8);
        match taken {
            8 => run(&mut take::<J, 8>(jobs)),
            7 => run(&mut take::<J, 7>(jobs)),
            6 => run(&mut take::<J, 6>(jobs)),
            5 => run(&mut take::<J, 5>(jobs)),
            4 => run(&mut take::<J, 4>(jobs)),
            3 => run(&mut take::<J, 3>(jobs)),
            2 => run(&mut take::<J, 2>(jobs)),
            _ => run(&mut take::<J, 1>(jobs)),
        }
        left -= taken;
    }
}

/// `gate = act(gate, up)` elementwise, the experts' activation (Split gate and up).
fn activate(activation: ExpertActivation, gate: &mut [f32], up: &[f32]) {
    match activation {
        ExpertActivation::Silu => kernels::silu_mul(gate, up),
        ExpertActivation::GeluTanh => kernels::gelu_tanh_mul(gate, up),
        ExpertActivation::ClampedSwiGlu { alpha, limit } => {
            kernels::clamped_swiglu_mul(gate, up, alpha as f32, limit as f32)
        }
    }
}

/// One expert over `count` gathered tokens: `x (count, hidden)` -> gate, up `(count, width)`
/// -> `act` -> `y (count, hidden)`.
#[allow(clippy::too_many_arguments)]
fn run_expert(
    c: &Step<'_>,
    expert: &Expert,
    activation: ExpertActivation,
    x: &[f32],
    count: usize,
    width: usize,
    gate: &mut [f32],
    up: &mut [f32],
    y: &mut [f32],
    p: &mut ProductScratch,
) {
    let hidden_in = match &expert.gate_up {
        GateUp::Split { gate: g, up: u } => {
            let (gate, up) = (&mut gate[..count * width], &mut up[..count * width]);
            Linear::forward_many(c.mm, x, count, [(g, &mut *gate), (u, &mut *up)], p);
            activate(activation, gate, up);
            &gate[..count * width]
        }
        GateUp::Interleaved(m) => {
            // gate_up (count, 2 · width), gate at even columns -> act (count, width) in `up`.
            let pairs = &mut gate[..count * 2 * width];
            m.forward(c.mm, x, count, pairs, p);
            let (alpha, limit) = match activation {
                ExpertActivation::ClampedSwiGlu { alpha, limit } => (alpha as f32, limit as f32),
                // Only gpt-oss interleaves; its activation is the clamped SwiGLU.
                _ => (1.702, f32::INFINITY),
            };
            kernels::clamped_swiglu_interleaved(pairs, &mut up[..count * width], alpha, limit);
            &up[..count * width]
        }
    };
    expert.down.forward(c.mm, hidden_in, count, y, p);
}

/// The stored per-expert vectors a router reads beside its logits.
#[derive(Clone, Copy)]
struct Tables<'a> {
    /// Gemma 4's `per_expert_scale`.
    expert_scale: Option<&'a [f32]>,
    /// LFM2-MoE's `expert_bias`, GLM-4.5's `e_score_correction_bias`.
    selection_bias: Option<&'a [f32]>,
}

/// One token's experts and weights from its router logits `row` (overwritten), as the family's
/// router computes them in transformers.
fn route(routing: Routing, row: &mut [f32], experts: &mut [u32], weights: &mut [f32], tables: Tables<'_>) {
    match routing {
        Routing::SoftmaxTopK { normalize } => {
            kernels::softmax(row);
            top_k(row, experts, weights);
            if normalize {
                normalise(weights);
            }
        }
        Routing::TopKSoftmax => {
            top_k(row, experts, weights);
            kernels::softmax(weights);
        }
        Routing::Gemma4 => {
            kernels::softmax(row);
            top_k(row, experts, weights);
            normalise(weights);
            if let Some(scale) = tables.expert_scale {
                for (w, &e) in weights.iter_mut().zip(experts.iter()) {
                    *w *= scale[e as usize];
                }
            }
        }
        Routing::SigmoidTopK { normalize, scale, groups, kept_groups, normalize_epsilon, .. } => {
            // s = sigmoid(logit) in f32, as torch computes it: 1 / (1 + exp(-x)).
            for v in row.iter_mut() {
                *v = 1.0 / (1.0 + (-*v).exp());
            }
            // Choose by s + bias (the bias only selects); weigh by s alone (transformers'
            // `torch.gather`).
            let row = &*row;
            let choice = |i: usize| match tables.selection_bias {
                Some(bias) => row[i] + bias[i],
                None => row[i],
            };
            let kept = kept_groups_of(row.len(), groups, kept_groups, &choice);
            let group_size = row.len() / groups.clamp(1, MAX_EXPERT_GROUPS);
            top_k_by(row.len(), |i| if kept[i / group_size] { choice(i) } else { f32::NEG_INFINITY }, experts, weights);
            for (w, &e) in weights.iter_mut().zip(experts.iter()) {
                *w = row[e as usize];
            }
            if normalize {
                // w / (Σ w + epsilon), the sum taken in order.
                let sum: f32 = weights.iter().sum::<f32>() + normalize_epsilon as f32;
                for w in weights.iter_mut() {
                    *w /= sum;
                }
            }
            let scale = scale as f32;
            for w in weights.iter_mut() {
                *w *= scale;
            }
        }
    }
}

/// DeepSeek-V3's group-limited choice (GLM-4.5's `n_group`, `topk_group`): the experts split
/// into `groups` equal groups, each scored by the sum of its two best `choice` values; the
/// best `kept_groups` stay (ties to the lower index). One group keeps every expert.
fn kept_groups_of(
    experts: usize,
    groups: usize,
    kept_groups: usize,
    choice: &impl Fn(usize) -> f32,
) -> [bool; MAX_EXPERT_GROUPS] {
    let groups = groups.clamp(1, MAX_EXPERT_GROUPS);
    if kept_groups >= groups {
        return [true; MAX_EXPERT_GROUPS];
    }
    let size = experts / groups;
    let mut score = [f32::NEG_INFINITY; MAX_EXPERT_GROUPS];
    for (g, score) in score.iter_mut().enumerate().take(groups) {
        let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for i in g * size..(g + 1) * size {
            let v = choice(i);
            if v > first {
                second = first;
                first = v;
            } else if v > second {
                second = v;
            }
        }
        *score = first + second;
    }
    let mut kept = [false; MAX_EXPERT_GROUPS];
    for _ in 0..kept_groups {
        let best = (0..groups).filter(|&g| !kept[g]).fold(None, |best: Option<usize>, g| match best {
            Some(b) if score[b] >= score[g] || score[g].is_nan() => Some(b),
            _ => Some(g),
        });
        if let Some(b) = best {
            kept[b] = true;
        }
    }
    kept
}

/// `weights /= Σ weights`, the sum taken in order (`top_k` is small).
fn normalise(weights: &mut [f32]) {
    let sum: f32 = weights.iter().sum();
    for w in weights.iter_mut() {
        *w /= sum;
    }
}

/// The `k = experts.len()` largest values of `row`, best first (ties to the lower index, as
/// `torch.topk` gives them on a CPU), with their indices.
fn top_k(row: &[f32], experts: &mut [u32], weights: &mut [f32]) {
    top_k_by(row.len(), |i| row[i], experts, weights);
}

/// [`top_k`] over the values `value(0..len)`.
fn top_k_by(len: usize, value: impl Fn(usize) -> f32, experts: &mut [u32], weights: &mut [f32]) {
    let k = experts.len();
    for slot in 0..k {
        let mut best: Option<usize> = None;
        for i in 0..len {
            if experts[..slot].contains(&(i as u32)) {
                continue;
            }
            let v = value(i);
            // A NaN never wins; the first of equal values does.
            if best.is_none_or(|b| v > value(b)) && !v.is_nan() {
                best = Some(i);
            }
        }
        let b = best.unwrap_or(0);
        experts[slot] = b as u32;
        weights[slot] = value(b);
    }
}

/// Sorts a token's (expert, weight) pairs by expert index (insertion sort: `k` is small).
fn sort_by_expert(experts: &mut [u32], weights: &mut [f32]) {
    for i in 1..experts.len() {
        let mut j = i;
        while j > 0 && experts[j - 1] > experts[j] {
            experts.swap(j - 1, j);
            weights.swap(j - 1, j);
            j -= 1;
        }
    }
}

/// A float tensor's values as f32, checked against `shape`.
fn float_values(t: &WeightTensor, shape: &[usize]) -> Result<Vec<f32>> {
    if t.shape != shape {
        return Err(KylinError::tensor_shape_mismatch(format!(
            "tensor '{}' has shape {:?}; expected {shape:?}",
            t.name, t.shape
        )));
    }
    let bytes = t.bytes();
    let values: Vec<f32> = match t.dtype {
        DType::BF16 => {
            bytes.chunks_exact(2).map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16)).collect()
        }
        DType::F16 => bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
        DType::F32 => bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
        other => {
            return Err(KylinError::tensor_dtype_unsupported(format!(
                "tensor '{}' is stored as {}; input-major experts must be BF16, F16 or F32",
                t.name,
                other.as_str()
            )));
        }
    };
    Ok(values)
}

/// An owned tensor of `values` in `dtype` (the source's: the copies are exact).
fn owned(name: String, dtype: DType, shape: Vec<usize>, values: &[f32]) -> Result<WeightTensor> {
    let bytes: Vec<u8> = match dtype {
        DType::BF16 => values.iter().flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes()).collect(),
        DType::F16 => values.iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    let dtype = if matches!(dtype, DType::BF16 | DType::F16) { dtype } else { DType::F32 };
    WeightTensor::owned(name.clone(), dtype, shape, bytes)
        .ok_or_else(|| KylinError::tensor_shape_mismatch(format!("'{name}': values do not fill their shape")))
}
