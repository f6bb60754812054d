//! Rotary position embeddings (RoPE) exactly as Hugging Face transformers computes them.
//!
//! `transformers.modeling_rope_utils` computes the inverse frequencies in float32 (`base **
//! (arange(0, dim, 2).float() / dim)`, then a reciprocal), scales them per RoPE type (`linear`,
//! `dynamic`, `yarn`, `llama3`), multiplies positions by them in float32 and takes cos/sin, which
//! `yarn` scales by its attention factor. This module mirrors every one of those float32 steps so
//! the angles match transformers to the last bit wherever the platform's `pow`/`cos` round
//! correctly, and within one ulp otherwise.
//!
//! Guarantees: the cos/sin tables cover the whole planned context and are computed up front;
//! [`Rope::prepare`] allocates nothing. Only `dynamic` RoPE changes its frequencies at run time,
//! and it does so as transformers' `dynamic_rope_update` does: the frequencies grow with the
//! largest position of each forward call and are never recomputed for keys already cached.

use kylin_loader::{KylinError, Result, RopeConfig, RopeScaling};

/// The rotary tables of one model: one per distinct RoPE its layers use (Gemma 3: global and
/// local), each for positions `0..capacity`.
#[derive(Debug, Clone)]
pub struct Ropes {
    tables: Vec<Rope>,
}

impl Ropes {
    /// One table per configuration and the head width it rotates, in order (layers refer to
    /// them by index).
    pub fn new(configs: &[(RopeConfig, usize)], capacity: usize) -> Result<Self> {
        let tables =
            configs.iter().map(|(c, head_dim)| Rope::new(c, *head_dim, capacity)).collect::<Result<Vec<_>>>()?;
        Ok(Ropes { tables })
    }

    /// [`Rope::prepare`] on every table.
    pub fn prepare(&mut self, start: usize, end: usize) {
        for t in &mut self.tables {
            t.prepare(start, end);
        }
    }

    /// Table `index`.
    #[inline]
    pub fn table(&self, index: usize) -> &Rope {
        &self.tables[index]
    }
}

/// NTK-aware dynamic scaling state, mirroring transformers' rotary module attributes.
#[derive(Debug, Clone)]
struct DynamicState {
    theta: f64,
    factor: f64,
    /// `original_max_seq_len` in transformers: the length up to which the base is unchanged.
    original_max: usize,
    /// `max_seq_len_cached` in transformers: the sequence length the current frequencies were made for.
    max_seq_len_cached: usize,
    /// The frequencies at initialisation, restored when a short sequence follows a long one.
    original_inv_freq: Vec<f32>,
}

/// Precomputed rotary tables for positions `0..capacity` of one model.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Half the rotated dimension: the number of distinct frequencies.
    half: usize,
    capacity: usize,
    /// Current inverse frequencies, `(half)`.
    inv_freq: Vec<f32>,
    /// Scaling applied to cos and sin (`attention_factor` for yarn, 1 otherwise).
    attention_scaling: f32,
    /// `(capacity, half)` row-major: `cos[p * half + i] = cos(p * inv_freq[i]) * attention_scaling`.
    cos: Vec<f32>,
    /// `(capacity, half)` row-major, like `cos`.
    sin: Vec<f32>,
    dynamic: Option<DynamicState>,
    /// Multimodal RoPE: the axis (0 time, 1 height, 2 width) whose position each frequency
    /// takes, `(half)`; `None` for the ordinary RoPE.
    axes: Option<Vec<u8>>,
}

impl Rope {
    /// Builds the tables for `capacity` positions of heads of `head_dim` elements, of which
    /// the first `int(head_dim · partial_rotary_factor)` are rotated (transformers' rule).
    ///
    /// `OPERATOR_UNSUPPORTED` for an odd or zero rotated dimension, or LongRoPE factor lists
    /// of another length than half of it. LongRoPE uses `long_factor` when the planned
    /// context `capacity` exceeds `original_max_position_embeddings`, else `short_factor`
    /// (llama.cpp's choice; transformers switches per forward call by the longest sequence,
    /// which the two agree on whenever every sequence stays on one side of the boundary).
    pub fn new(config: &RopeConfig, head_dim: usize, capacity: usize) -> Result<Self> {
        // Proportional RoPE rotates the whole head; its partial factor zeroes frequencies instead.
        let dim = match config.scaling {
            RopeScaling::Proportional { .. } => head_dim,
            _ => (head_dim as f64 * config.partial_rotary_factor) as usize,
        };
        if dim == 0 || !dim.is_multiple_of(2) || dim > head_dim {
            return Err(KylinError::operator_unsupported(format!(
                "RoPE needs an even, non-zero rotated dimension; head_dim {head_dim} x partial_rotary_factor {} gives {dim}",
                config.partial_rotary_factor
            )));
        }
        if let RopeScaling::LongRope { short_factor, long_factor, .. } = &config.scaling
            && (short_factor.len() != dim / 2 || long_factor.len() != dim / 2)
        {
            return Err(KylinError::config_invalid(format!(
                "config.json longrope short_factor has {} entries and long_factor {}; the rotated dimension {dim} needs {} each",
                short_factor.len(),
                long_factor.len(),
                dim / 2
            )));
        }
        let head_dim = dim;
        let half = head_dim / 2;
        let table_len = capacity.checked_mul(half).ok_or_else(|| {
            KylinError::config_invalid(format!("RoPE table of {capacity} positions x {half} overflows"))
        })?;
        let (inv_freq, attention_scaling) = initial_inv_freq(config, head_dim, capacity);
        if inv_freq.len() != half {
            return Err(KylinError::operator_unsupported(format!(
                "RoPE frequencies: {} for a rotated dimension of {head_dim}",
                inv_freq.len()
            )));
        }
        let dynamic = match config.scaling {
            RopeScaling::Dynamic { factor, original_max_position_embeddings } => Some(DynamicState {
                theta: config.theta,
                factor,
                original_max: original_max_position_embeddings,
                max_seq_len_cached: original_max_position_embeddings,
                original_inv_freq: inv_freq.clone(),
            }),
            _ => None,
        };
        let mut rope = Rope {
            half,
            capacity,
            inv_freq,
            attention_scaling,
            cos: vec![0.0; table_len],
            sin: vec![0.0; table_len],
            dynamic,
            axes: config.multimodal.map(|m| m.axes(half)),
        };
        rope.fill_rows(0, capacity);
        Ok(rope)
    }

    /// Number of distinct frequencies (half the rotated dimension).
    pub fn half(&self) -> usize {
        self.half
    }

    /// The rotated dimensions at the start of each head (`head_dim` unless partial).
    pub fn rotary_dim(&self) -> usize {
        2 * self.half
    }

    /// Positions covered by the tables.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The current inverse frequencies, `(head_dim / 2)`.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Makes the rows of positions `start..end` valid for a forward call over exactly those
    /// positions. A no-op except for `dynamic` RoPE, which updates its frequencies from the
    /// call's sequence length `end` the way transformers' `dynamic_rope_update` does.
    /// The caller guarantees `end <= capacity`.
    pub fn prepare(&mut self, start: usize, end: usize) {
        let Some(dynamic) = self.dynamic.as_mut() else {
            return;
        };
        let seq_len = end;
        if seq_len > dynamic.max_seq_len_cached {
            // Growth: transformers recomputes the frequencies with `seq_len` a tensor, so the
            // new base is computed in float32 arithmetic.
            dynamic_inv_freq(dynamic.theta, dynamic.factor, dynamic.original_max, seq_len, &mut self.inv_freq);
            dynamic.max_seq_len_cached = seq_len;
        }
        if seq_len < dynamic.original_max && dynamic.max_seq_len_cached > dynamic.original_max {
            // Reset: a short sequence after a long one goes back to the original frequencies.
            self.inv_freq.copy_from_slice(&dynamic.original_inv_freq);
            dynamic.max_seq_len_cached = dynamic.original_max;
        }
        self.fill_rows(start, end);
    }

    /// cos of position `pos`, `(head_dim / 2)`.
    #[inline]
    pub fn cos(&self, pos: usize) -> &[f32] {
        &self.cos[pos * self.half..(pos + 1) * self.half]
    }

    /// Whether the table is a multimodal RoPE (positions per axis, [`Rope::cos_sin_at`]).
    pub fn is_multimodal(&self) -> bool {
        self.axes.is_some()
    }

    /// cos and sin, `(head_dim / 2)` each, of a multimodal position (time, row, column): each
    /// frequency at the position of its axis, read from the tables (transformers'
    /// `recomposition_frequencies`). For the ordinary RoPE, the time position's rows.
    /// The caller guarantees every position is below the capacity.
    pub fn cos_sin_at(&self, pos: [u32; 3], cos: &mut [f32], sin: &mut [f32]) {
        let half = self.half;
        match &self.axes {
            Some(axes) => {
                for (i, &axis) in axes.iter().enumerate() {
                    let row = pos[axis as usize] as usize * half + i;
                    cos[i] = self.cos[row];
                    sin[i] = self.sin[row];
                }
            }
            None => {
                cos[..half].copy_from_slice(self.cos(pos[0] as usize));
                sin[..half].copy_from_slice(self.sin(pos[0] as usize));
            }
        }
    }

    /// sin of position `pos`, `(head_dim / 2)`.
    #[inline]
    pub fn sin(&self, pos: usize) -> &[f32] {
        &self.sin[pos * self.half..(pos + 1) * self.half]
    }

    /// Recomputes rows `start..end` from the current frequencies, as transformers does:
    /// `freqs = inv_freq (f32) * position (f32)`, then `cos(freqs) * attention_scaling` in f32.
    fn fill_rows(&mut self, start: usize, end: usize) {
        let half = self.half;
        for pos in start..end.min(self.capacity) {
            let p = pos as f32;
            let cos_row = &mut self.cos[pos * half..(pos + 1) * half];
            let sin_row = &mut self.sin[pos * half..(pos + 1) * half];
            for ((c, s), &f) in cos_row.iter_mut().zip(sin_row.iter_mut()).zip(&self.inv_freq) {
                // The angle is rounded to f32 exactly as torch's float32 product; cos/sin are
                // then evaluated in f64 and rounded once, i.e. correctly rounded f32 results.
                let angle = (f * p) as f64;
                *c = (angle.cos() as f32) * self.attention_scaling;
                *s = (angle.sin() as f32) * self.attention_scaling;
            }
        }
    }
}

/// `base ** (2i / dim)` in float32, as `base ** (torch.arange(0, dim, 2).float() / dim)`:
/// the exponent is a float32 division and the power is float32 (evaluated in f64 and rounded
/// once, i.e. correctly rounded).
fn pos_freq(base: f32, i: usize, dim: usize) -> f32 {
    let exponent = (2 * i) as f32 / dim as f32;
    (base as f64).powf(exponent as f64) as f32
}

/// The default frequencies `1 / base ** (2i / dim)`, all in float32.
fn default_inv_freq(theta: f64, dim: usize, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = 1.0 / pos_freq(theta as f32, i, dim);
    }
}

/// transformers' dynamic-NTK frequencies for a call whose sequence length is `seq_len`
/// (`seq_len` is a tensor there, so the base is computed in float32).
fn dynamic_inv_freq(theta: f64, factor: f64, original_max: usize, seq_len: usize, out: &mut [f32]) {
    let dim = out.len() * 2;
    let seq_len = seq_len.max(original_max) as f32;
    let factor32 = factor as f32;
    // base * ((factor * seq_len / max) - (factor - 1)) ** (dim / (dim - 2))
    let ratio = factor32 * seq_len / original_max as f32 - (factor - 1.0) as f32;
    let exponent = (dim as f64 / (dim as f64 - 2.0)) as f32;
    let scale = (ratio as f64).powf(exponent as f64) as f32;
    let base = theta as f32 * scale;
    default_inv_freq(base as f64, dim, out);
}

/// The frequencies and cos/sin scaling at initialisation, per RoPE type.
fn initial_inv_freq(config: &RopeConfig, head_dim: usize, capacity: usize) -> (Vec<f32>, f32) {
    let dim = head_dim;
    let half = dim / 2;
    let mut inv_freq = vec![0.0f32; half];
    default_inv_freq(config.theta, dim, &mut inv_freq);
    match config.scaling.clone() {
        RopeScaling::Default => (inv_freq, 1.0),
        RopeScaling::Linear { factor } => {
            // `inv_freq /= factor` on a float32 tensor.
            let factor = factor as f32;
            for f in inv_freq.iter_mut() {
                *f /= factor;
            }
            (inv_freq, 1.0)
        }
        // At initialisation transformers calls the dynamic function with the original length,
        // which leaves the base unchanged.
        RopeScaling::Dynamic { .. } => (inv_freq, 1.0),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
            truncate,
            ..
        } => {
            yarn_inv_freq(
                config.theta,
                dim,
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                &mut inv_freq,
            );
            (inv_freq, attention_factor as f32)
        }
        RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
            llama3_inv_freq(factor, low_freq_factor, high_freq_factor, original_max_position_embeddings, &mut inv_freq);
            (inv_freq, 1.0)
        }
        RopeScaling::LongRope {
            ref short_factor,
            ref long_factor,
            original_max_position_embeddings,
            attention_factor,
        } => {
            // `1 / (ext_factors * base ** (arange(0, dim, 2) / dim))`, all float32.
            let ext = if capacity > original_max_position_embeddings { long_factor } else { short_factor };
            for (i, (o, &e)) in inv_freq.iter_mut().zip(ext).enumerate() {
                *o = 1.0 / (e as f32 * pos_freq(config.theta as f32, i, dim));
            }
            (inv_freq, attention_factor as f32)
        }
        RopeScaling::Proportional { factor } => {
            // transformers' `_compute_proportional_rope_parameters`: `rope_angles =
            // int(partial_rotary_factor * head_dim // 2)` frequencies `1 / base ** (2i /
            // head_dim)`, zeros after them, all divided by `factor` in float32.
            let rope_angles = ((config.partial_rotary_factor * dim as f64) / 2.0).floor() as usize;
            let factor = factor as f32;
            for (i, f) in inv_freq.iter_mut().enumerate() {
                *f = if i < rope_angles { *f / factor } else { 0.0 };
            }
            (inv_freq, 1.0)
        }
    }
}

/// YaRN: a blend of interpolated (`/ factor`) and extrapolated (unchanged) frequencies with a
/// linear ramp between the correction dimensions of `beta_fast` and `beta_slow` rotations.
#[allow(clippy::too_many_arguments)]
fn yarn_inv_freq(
    theta: f64,
    dim: usize,
    factor: f64,
    original_max: usize,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
    out: &mut [f32],
) {
    // Python double arithmetic: the inverse dimension formula.
    let find_correction_dim = |num_rotations: f64| -> f64 {
        (dim as f64 * (original_max as f64 / (num_rotations * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * theta.ln())
    };
    let mut low = find_correction_dim(beta_fast);
    let mut high = find_correction_dim(beta_slow);
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min((dim - 1) as f64);
    if low == high {
        // transformers: "Prevent singularity".
        high += 0.001;
    }
    // `(arange(dim // 2) - min) / (max - min)` in float32, both scalars cast to f32.
    let min32 = low as f32;
    let span32 = (high - low) as f32;
    let factor32 = factor as f32;
    for (i, o) in out.iter_mut().enumerate() {
        let pos_freq = pos_freq(theta as f32, i, dim);
        let extrapolation = 1.0 / pos_freq;
        let interpolation = 1.0 / (factor32 * pos_freq);
        let ramp = ((i as f32 - min32) / span32).clamp(0.0, 1.0);
        let extrapolation_factor = 1.0 - ramp;
        *o = interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor;
    }
}

/// Llama 3.1: low frequencies divided by `factor`, high ones kept, a smooth blend in between,
/// chosen by wavelength; every step in float32 as transformers' tensor arithmetic does.
fn llama3_inv_freq(
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original_max: usize,
    inv_freq: &mut [f32],
) {
    let old_context_len = original_max as f64;
    let low_freq_wavelen = (old_context_len / low_freq_factor) as f32;
    let high_freq_wavelen = (old_context_len / high_freq_factor) as f32;
    let two_pi = (2.0 * std::f64::consts::PI) as f32;
    let factor32 = factor as f32;
    for f in inv_freq.iter_mut() {
        let inv = *f;
        // `2 * pi / inv_freq` is `inv_freq.reciprocal() * (2 * pi)` in torch.
        let wavelen = (1.0 / inv) * two_pi;
        let scaled = if wavelen > low_freq_wavelen { inv / factor32 } else { inv };
        let smooth_factor = ((1.0 / wavelen) * old_context_len as f32 - low_freq_factor as f32)
            / (high_freq_factor - low_freq_factor) as f32;
        let smoothed = (1.0 - smooth_factor) * scaled / factor32 + smooth_factor * scaled;
        // transformers' `~(wavelen < high) & ~(wavelen > low)`, negations kept as written.
        #[allow(clippy::neg_cmp_op_on_partial_ord)]
        let is_medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
        *f = if is_medium { smoothed } else { scaled };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(scaling: RopeScaling, theta: f64) -> RopeConfig {
        RopeConfig { theta, partial_rotary_factor: 1.0, scaling, multimodal: None }
    }

    #[test]
    fn default_frequencies_match_the_closed_form() {
        let rope = Rope::new(&config(RopeScaling::Default, 10000.0), 8, 4).unwrap();
        // 1 / 10000^(0/8), 1 / 10000^(2/8), 1 / 10000^(4/8), 1 / 10000^(6/8).
        let expected = [1.0f32, 0.1, 0.01, 0.001];
        for (got, want) in rope.inv_freq().iter().zip(expected) {
            assert!((got - want).abs() <= want * 1e-6, "{got} vs {want}");
        }
        // Position 0 is the identity rotation, position 1 rotates by the frequencies.
        assert!(rope.cos(0).iter().all(|&c| c == 1.0));
        assert!(rope.sin(0).iter().all(|&s| s == 0.0));
        assert_eq!(rope.sin(1)[0], 1.0f64.sin() as f32);
    }

    #[test]
    fn linear_divides_every_frequency() {
        let plain = Rope::new(&config(RopeScaling::Default, 10000.0), 16, 2).unwrap();
        let linear = Rope::new(&config(RopeScaling::Linear { factor: 4.0 }, 10000.0), 16, 2).unwrap();
        for (a, b) in plain.inv_freq().iter().zip(linear.inv_freq()) {
            assert_eq!(*b, a / 4.0);
        }
    }

    #[test]
    fn llama3_keeps_high_and_divides_low_frequencies() {
        let scaling = RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        };
        let plain = Rope::new(&config(RopeScaling::Default, 500000.0), 8, 2).unwrap();
        let rope = Rope::new(&config(scaling, 500000.0), 8, 2).unwrap();
        // Wavelength 2*pi < 16: unchanged. The lowest frequency has a wavelength far above 64: / 8.
        assert_eq!(rope.inv_freq()[0], plain.inv_freq()[0]);
        assert_eq!(rope.inv_freq()[3], plain.inv_freq()[3] / 8.0);
    }

    #[test]
    fn yarn_scales_cos_and_sin_by_the_attention_factor() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 128,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            attention_factor: 0.1 * 4.0f64.ln() + 1.0,
            truncate: true,
        };
        let rope = Rope::new(&config(scaling, 1e6), 16, 3).unwrap();
        let scale = (0.1 * 4.0f64.ln() + 1.0) as f32;
        assert_eq!(rope.cos(0)[0], scale);
        // The highest frequency is extrapolated (kept), the lowest interpolated (/ factor).
        let plain = Rope::new(&config(RopeScaling::Default, 1e6), 16, 2).unwrap();
        assert_eq!(rope.inv_freq()[0], plain.inv_freq()[0]);
        let lowest = 1.0 / (4.0 * pos_freq(1e6, 7, 16));
        assert_eq!(rope.inv_freq()[7], lowest);
    }

    #[test]
    fn dynamic_grows_the_base_past_the_original_length_and_resets() {
        let scaling = RopeScaling::Dynamic { factor: 2.0, original_max_position_embeddings: 8 };
        let mut rope = Rope::new(&config(scaling, 10000.0), 8, 32).unwrap();
        let original = rope.inv_freq().to_vec();
        rope.prepare(0, 8);
        assert_eq!(rope.inv_freq(), &original[..]);
        rope.prepare(8, 16);
        assert!(rope.inv_freq()[1] < original[1], "a longer sequence lowers the frequencies");
        assert_eq!(rope.inv_freq()[0], 1.0);
        rope.prepare(0, 4);
        assert_eq!(rope.inv_freq(), &original[..]);
    }

    #[test]
    fn odd_head_dim_is_rejected() {
        let err = Rope::new(&config(RopeScaling::Default, 10000.0), 7, 2).unwrap_err();
        assert_eq!(err.code(), kylin_loader::ErrorCode::OperatorUnsupported);
    }
}
