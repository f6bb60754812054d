//! The gated MLP every dense family runs: `down(act(gate(x)) · up(x))`, with SiLU (SwiGLU) or
//! the tanh GELU (GeGLU).

use kylin_kernels::{self as kernels};
use kylin_loader::arch::Role;
use kylin_loader::family::Activation;
use kylin_loader::{LayerWeights, ModelWeights, Result};

use super::Step;
use super::linear::Linear;
use super::scratch::Scratch;

/// One layer's gated MLP, `[intermediate, hidden]` gate and up, `[hidden, intermediate]` down.
#[derive(Debug, Clone)]
pub(super) struct Mlp {
    pub(super) gate_proj: Linear,
    pub(super) up_proj: Linear,
    pub(super) down_proj: Linear,
    pub(super) intermediate: usize,
    activation: Activation,
}

impl Mlp {
    /// Binds layer `index`'s MLP of width `intermediate`, checking every shape.
    pub(super) fn new(
        w: &LayerWeights,
        index: usize,
        hidden: usize,
        intermediate: usize,
        activation: Activation,
        weights: &ModelWeights,
    ) -> Result<Self> {
        let linear = |weight: Role, bias: Role, rows: usize, cols: usize| -> Result<Linear> {
            Linear::bind(w.require(weight, index)?, w.get(bias), rows, cols, weights)
        };
        Ok(Mlp {
            gate_proj: linear(Role::GateProj, Role::GateBias, intermediate, hidden)?,
            up_proj: linear(Role::UpProj, Role::UpBias, intermediate, hidden)?,
            down_proj: linear(Role::DownProj, Role::DownBias, hidden, intermediate)?,
            intermediate,
            activation,
        })
    }

    /// The three matrices with their roles: gate, up, down.
    pub(super) fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        [(Role::GateProj, &self.gate_proj), (Role::UpProj, &self.up_proj), (Role::DownProj, &self.down_proj)]
            .into_iter()
    }

    pub(super) fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        [&mut self.gate_proj, &mut self.up_proj, &mut self.down_proj].into_iter()
    }

    /// `proj (n, hidden) = down_proj(act(gate_proj(h)) * up_proj(h))` with `h` the normed
    /// input `xn` (`normed`) or the residual stream `x`.
    pub(super) fn forward(&self, c: &Step<'_>, s: &mut Scratch, n: usize, normed: bool) {
        let (h, i) = (c.hidden, self.intermediate);
        let input = if normed { &s.xn[..n * h] } else { &s.x[..n * h] };

        // 1. gate and up: input (n, hidden) -> (n, intermediate) each; gate = act(gate) * up.
        Linear::forward_many(
            c.mm,
            input,
            n,
            [(&self.gate_proj, &mut s.gate[..n * i]), (&self.up_proj, &mut s.up[..n * i])],
            &mut s.products,
        );
        let up = &s.up[..n * i];
        super::for_row_slices(c.mm.pool, &mut s.gate[..n * i], i, &|rows, gate| {
            let up = &up[rows.start * i..rows.end * i];
            match self.activation {
                Activation::Silu => kernels::silu_mul(gate, up),
                Activation::GeluTanh => kernels::gelu_tanh_mul(gate, up),
            }
        });

        // 2. down: gate (n, intermediate) -> proj (n, hidden).
        self.down_proj.forward(c.mm, &s.gate[..n * i], n, &mut s.proj[..n * h], &mut s.products);
    }
}
