//! LFM2's short convolution (`conv.*`): `B, C, x = in_proj(h)`, `y = C · conv(B · x)` with a
//! causal depthwise convolution over the sequence's last `kernel - 1` rows of `B · x`, then
//! `out_proj(y)`.
//!
//! Guarantees: every shape is checked in [`ShortConv::new`]; [`ShortConv::forward`] allocates
//! nothing; each token's result depends only on its sequence (the convolution continues from
//! the rows in the sequence's live slot), never on what else is in the batch.

use kylin_kernels::delta;
use kylin_kernels::{WeightDType, WeightMatrix};
use kylin_loader::arch::Role;
use kylin_loader::family::ShortConv as ShortConvSpec;
use kylin_loader::{KylinError, LayerWeights, ModelWeights, Result, WeightTensor};

use super::linear::{Linear, Vector, shape_error, weight_dtype};
use super::scratch::Scratch;
use super::{BatchPlan, Step};
use crate::state_pool::{RecurrentShape, StatePool};

/// One layer's short convolution, with its index among the model's recurrent layers.
#[derive(Debug, Clone)]
pub(super) struct ShortConv {
    /// `[3 · hidden, hidden]`: B, C and x.
    in_proj: Linear,
    /// `[hidden, 1, kernel]`, read in its stored dtype.
    conv: WeightTensor,
    conv_dtype: WeightDType,
    conv_bias: Option<Vector>,
    /// `[hidden, hidden]`.
    out_proj: Linear,
    kernel: usize,
    hidden: usize,
    /// The layer's index among the model's recurrent layers (its place in the state pool).
    pub(super) state: usize,
}

impl ShortConv {
    /// Binds layer `index`'s short convolution, checking every shape.
    pub(super) fn new(
        w: &LayerWeights,
        index: usize,
        hidden: usize,
        spec: ShortConvSpec,
        state: usize,
        weights: &ModelWeights,
    ) -> Result<Self> {
        if spec.kernel == 0 || spec.kernel > delta::MAX_CONV_KERNEL {
            return Err(KylinError::operator_unsupported(format!(
                "layer {index}: a convolution of {} taps is outside the kernels' 1..={}",
                spec.kernel,
                delta::MAX_CONV_KERNEL
            )));
        }
        let conv = w.require(Role::ConvWeight, index)?;
        if conv.shape != [hidden, 1, spec.kernel] {
            return Err(shape_error(conv, &[hidden, 1, spec.kernel]));
        }
        Ok(ShortConv {
            in_proj: Linear::bind(
                w.require(Role::ConvInProj, index)?,
                w.get(Role::ConvInBias),
                3 * hidden,
                hidden,
                weights,
            )?,
            conv_dtype: weight_dtype(conv)?,
            conv: conv.clone(),
            conv_bias: Vector::optional(w.get(Role::ConvBias), hidden)?,
            out_proj: Linear::bind(
                w.require(Role::ConvOutProj, index)?,
                w.get(Role::ConvOutBias),
                hidden,
                hidden,
                weights,
            )?,
            kernel: spec.kernel,
            hidden,
            state,
        })
    }

    /// The state it keeps per sequence.
    pub(super) fn shape(&self) -> RecurrentShape {
        RecurrentShape::ShortConv { channels: self.hidden, taps: self.kernel }
    }

    /// The projections with their roles: in_proj, out_proj.
    pub(super) fn linears(&self) -> impl Iterator<Item = (Role, &Linear)> {
        [(Role::ConvInProj, &self.in_proj), (Role::ConvOutProj, &self.out_proj)].into_iter()
    }

    pub(super) fn linears_mut(&mut self) -> impl Iterator<Item = &mut Linear> {
        [&mut self.in_proj, &mut self.out_proj].into_iter()
    }

    /// The convolution's bias, if any (for parameter counts).
    pub(super) fn vectors(&self) -> impl Iterator<Item = &Vector> {
        self.conv_bias.iter()
    }

    pub(super) fn conv_tensor(&self) -> &WeightTensor {
        &self.conv
    }

    /// `proj (n, hidden)` for every segment of the batch, each continuing its sequence's rows
    /// in its live slot of `states`; the input is `xn` (`normed`) or the residual stream `x`.
    pub(super) fn forward(
        &self,
        c: &Step<'_>,
        states: &mut StatePool,
        s: &mut Scratch,
        plan: &BatchPlan,
        normed: bool,
    ) {
        let n = plan.tokens();
        let h = self.hidden;
        let input = if normed { &s.xn[..n * h] } else { &s.x[..n * h] };

        // 1. in_proj: input (n, hidden) -> bcx (n, 3 · hidden), each row B | C | x.
        self.in_proj.forward(c.mm, input, n, &mut s.lin_in[..n * 3 * h], &mut s.products);

        // 2. B · x (n, hidden).
        for t in 0..n {
            let row = &s.lin_in[t * 3 * h..(t + 1) * 3 * h];
            let (b, x) = (&row[..h], &row[2 * h..]);
            for ((out, b), x) in s.lin_mixed[t * h..(t + 1) * h].iter_mut().zip(b).zip(x) {
                *out = b * x;
            }
        }

        // 3. The causal convolution per segment over its sequence's last rows (no activation):
        //    (n, hidden) -> (n, hidden); the rows at the last chunk boundary the segment
        //    reaches become the slot's anchor.
        let conv = WeightMatrix { dtype: self.conv_dtype, rows: h, cols: self.kernel, data: self.conv.bytes() };
        let bias = self.conv_bias.as_ref().map(Vector::view);
        super::delta_net::convolve_segments(plan, states, self.state, conv, bias, false, &s.lin_mixed, &mut s.lin_core);

        // 4. y = C · conv (n, hidden); out_proj: (n, hidden) -> proj (n, hidden).
        for t in 0..n {
            let cgate = &s.lin_in[t * 3 * h + h..t * 3 * h + 2 * h];
            for ((y, cv), conv) in
                s.lin_z[t * h..(t + 1) * h].iter_mut().zip(cgate).zip(&s.lin_core[t * h..(t + 1) * h])
            {
                *y = cv * conv;
            }
        }
        self.out_proj.forward(c.mm, &s.lin_z[..n * h], n, &mut s.proj[..n * h], &mut s.products);
    }
}
