//! The run-time quantization of a linear layer's input that a published scheme asks for
//! (compressed-tensors' `input_activations`, fine-grained FP8's `activation_scheme`), applied
//! under `--precision f32` before the f32 product with the exactly dequantized weights.
//!
//! Guarantees:
//! - The numbers are compressed-tensors' own (`compute_dynamic_scales_and_zp`,
//!   `calculate_qparams`, `_quantize_dequantize`), operation for operation in f32: per token or
//!   per token and group of columns, the range `[min(x, 0), max(x, 0)]`; symmetric scale
//!   `max(|min|, |max|) / (range / 2)` (int8: `/ 127.5`, FP8 E4M3: `/ 448`), asymmetric
//!   `(max − min) / 255` with the zero point `round(clamp(−128 − min / scale))`; a zero scale
//!   becomes f32's epsilon; then `q = round(clamp(x / scale + zero, qmin, qmax))` (int8: half
//!   to even; FP8: to the nearest E4M3 value, ties to even) and `x' = (q − zero) · scale`.
//!   A static scheme uses its stored `input_scale` the same way.
//! - Every scale is computed from one token's values, so a token's result does not depend on
//!   its batch (a per-tensor dynamic scale would; [`InputQuant::new`] refuses it).
//! - Nothing is allocated: the quantized copy goes to the planned `ProductScratch`.

use kylin_loader::published::{ActivationScales, ActivationScheme, ActivationType, PublishedMatrix, floats};
use kylin_loader::{KylinError, Result};

/// Where the scales of one layer's input come from.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scales {
    /// One per token.
    Token,
    /// One per token and group of this many columns (the last group may be narrower).
    Group(usize),
    /// The stored `input_scale`.
    Static(f32),
}

/// One linear layer's input quantization.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct InputQuant {
    kind: ActivationType,
    scales: Scales,
    symmetric: bool,
}

impl InputQuant {
    /// The input quantization of published matrix `m`, if its scheme has one.
    /// `OPERATOR_UNSUPPORTED` for a dynamic per-tensor scale (a scale over the whole batch
    /// breaks batch invariance); `FILE_CORRUPTED` for a stored scale that is not a positive
    /// finite number.
    pub(super) fn new(m: &PublishedMatrix) -> Result<Option<Self>> {
        let Some(ActivationScheme { kind, scales, symmetric }) = m.input else { return Ok(None) };
        let scales = match scales {
            ActivationScales::Token => Scales::Token,
            ActivationScales::Group(g) => Scales::Group(g),
            ActivationScales::Static => {
                let stored = m.input_scale.as_ref().map(floats).and_then(|v| v.first().copied());
                match stored {
                    Some(s) if s.is_finite() && s > 0.0 => Scales::Static(s),
                    _ => {
                        return Err(KylinError::file_corrupted(format!(
                            "tensor '{}.input_scale' holds {stored:?}; a static activation scale is a positive finite number",
                            m.module
                        )));
                    }
                }
            }
            ActivationScales::DynamicTensor => {
                return Err(KylinError::operator_unsupported(format!(
                    "module '{}': the checkpoint quantizes each call's whole input with one dynamic scale (input_activations strategy 'tensor', dynamic), which makes a sequence's numbers depend on its batch; --precision f32 computes per-token and per-group scales only: run it with --precision auto (the integer kernels, their own activation quantization)",
                    m.module
                )));
            }
        };
        Ok(Some(InputQuant { kind, scales, symmetric }))
    }

    /// `out (n, cols) = (q − zero) · scale` for every value of `x (n, cols)`, as the scheme
    /// quantizes it.
    pub(super) fn apply(&self, x: &[f32], cols: usize, out: &mut [f32]) {
        debug_assert_eq!(x.len(), out.len());
        let group = match self.scales {
            Scales::Group(g) => g.min(cols).max(1),
            Scales::Token | Scales::Static(_) => cols.max(1),
        };
        for (x, out) in x.chunks_exact(cols).zip(out.chunks_exact_mut(cols)) {
            for (x, out) in x.chunks(group).zip(out.chunks_mut(group)) {
                self.apply_group(x, out);
            }
        }
    }

    /// One token's group of values, with its own scale (or the stored one).
    fn apply_group(&self, x: &[f32], out: &mut [f32]) {
        let (lo, hi, half) = match self.kind {
            ActivationType::Int8 => (-128.0f32, 127.0f32, 127.5f32),
            ActivationType::Fp8E4M3 => (-448.0, 448.0, 448.0),
        };
        let (scale, zero) = match self.scales {
            Scales::Static(s) => (s, 0.0),
            Scales::Token | Scales::Group(_) => {
                // `calculate_qparams`: the range always holds zero.
                let (mut min, mut max) = (0.0f32, 0.0f32);
                for &v in x {
                    min = min.min(v);
                    max = max.max(v);
                }
                if self.symmetric {
                    let scale = min.abs().max(max.abs()) / half;
                    (if scale == 0.0 { f32::EPSILON } else { scale }, 0.0)
                } else {
                    let scale = (max - min) / (hi - lo);
                    if scale == 0.0 {
                        // Every value is zero: any zero point gives zeros.
                        (f32::EPSILON, 0.0)
                    } else {
                        (scale, (lo - min / scale).clamp(lo, hi).round_ties_even())
                    }
                }
            }
        };
        for (o, &v) in out.iter_mut().zip(x) {
            let scaled = (v / scale + zero).clamp(lo, hi);
            let q = match self.kind {
                ActivationType::Int8 => scaled.round_ties_even(),
                ActivationType::Fp8E4M3 => round_e4m3(scaled),
            };
            *o = (q - zero) * scale;
        }
    }
}

/// `v` (with `|v| ≤ 448`) rounded to the nearest FP8 E4M3 value, ties to even: what
/// `tensor.to(torch.float8_e4m3fn)` gives, as f32.
#[inline]
pub(super) fn round_e4m3(v: f32) -> f32 {
    let a = v.abs();
    // E4M3 has 3 mantissa bits: values of binade 2^e (e ≥ −6) are 2^(e − 3) apart; below
    // 2^−6 the subnormals are 2^−9 apart.
    let e = if a >= f32::from_bits((127 - 6) << 23) { ((a.to_bits() >> 23) & 0xff) as i32 - 127 } else { -6 };
    let step = f32::from_bits(((e - 3 + 127) as u32) << 23);
    // `a / step` and the product are exact (powers of two, no overflow or underflow here).
    ((a / step).round_ties_even() * step).copysign(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kylin_loader::published::fp8_e4m3_to_f32;

    #[test]
    fn e4m3_rounding_is_to_the_nearest_code_ties_to_even() {
        // Every finite code decodes to itself; every midpoint between neighbours goes to the
        // even code; values just off a midpoint go to the nearer code.
        let codes: Vec<f32> = (0u8..0x7F).map(fp8_e4m3_to_f32).collect();
        for (i, &c) in codes.iter().enumerate() {
            assert_eq!(round_e4m3(c), c, "code {i}");
            assert_eq!(round_e4m3(-c), -c, "code -{i}");
            if let Some(&next) = codes.get(i + 1) {
                let mid = (c + next) / 2.0;
                let even = if i % 2 == 0 { c } else { next };
                assert_eq!(round_e4m3(mid), even, "midpoint of codes {i} and {}", i + 1);
                assert_eq!(round_e4m3(f32::from_bits(mid.to_bits() - 1)), c);
                assert_eq!(round_e4m3(f32::from_bits(mid.to_bits() + 1)), next);
            }
        }
        assert_eq!(codes.last().copied(), Some(448.0));
    }

    fn quant(kind: ActivationType, scales: Scales, symmetric: bool) -> InputQuant {
        InputQuant { kind, scales, symmetric }
    }

    #[test]
    fn int8_per_token_follows_compressed_tensors() {
        // amax 2.55: scale 2.55 / 127.5 = 0.02; the maximum maps to 127.5, clamped to 127.
        let q = quant(ActivationType::Int8, Scales::Token, true);
        let x = [2.55f32, -2.55, 0.01, 0.03, 0.0, 1.0];
        let mut out = [0.0f32; 6];
        q.apply(&x, 6, &mut out);
        let s = 2.55f32 / 127.5;
        let want: Vec<f32> = x.iter().map(|&v| (v / s).clamp(-128.0, 127.0).round_ties_even() * s).collect();
        assert_eq!(out.to_vec(), want);
        assert_eq!(out[0], 127.0 * s, "127.5 clamps to 127");
        assert_eq!(out[1], -128.0 * s, "-127.5 rounds to -128 (even)");
        // Two tokens: each has its own scale, so the second is unaffected by the first.
        let two = [100.0f32, 1.0, 0.5, 1.0];
        let mut out2 = [0.0f32; 4];
        q.apply(&two, 2, &mut out2);
        let mut alone = [0.0f32; 2];
        q.apply(&two[2..], 2, &mut alone);
        assert_eq!(&out2[2..], &alone);
        // An all-zero token stays zero.
        let mut z = [1.0f32; 3];
        q.apply(&[0.0; 3], 3, &mut z);
        assert_eq!(z, [0.0; 3]);
    }

    /// Hex of little-endian f32 bytes to values.
    fn f32s(hex: &str) -> Vec<f32> {
        let bytes: Vec<u8> =
            (0..hex.len() / 2).map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("hex")).collect();
        bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
    }

    #[test]
    fn every_recorded_layer_input_rounds_as_compressed_tensors_rounds_it() {
        // Real inputs of the fixtures' layers and crafted rows (ties, zeros, tiny values), with
        // what compressed-tensors' `compute_dynamic_scales_and_zp` + `fake_quantize` make of
        // them (`scripts/make_quantized_fixtures.py`): the same bits.
        let path =
            concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/quantized/reference/input-quantization.json");
        let text = std::fs::read_to_string(path).expect("input-quantization.json");
        let doc: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let records = doc["records"].as_array().expect("records");
        assert!(records.len() >= 12);
        for r in records {
            let args = &r["args"];
            let kind = if args["type"] == "int" { ActivationType::Int8 } else { ActivationType::Fp8E4M3 };
            let scales = match args["strategy"].as_str() {
                Some("token") => Scales::Token,
                Some("group") => Scales::Group(args["group_size"].as_u64().expect("group_size") as usize),
                other => panic!("strategy {other:?}"),
            };
            let q = quant(kind, scales, args["symmetric"].as_bool().expect("symmetric"));
            let cols = r["cols"].as_u64().expect("cols") as usize;
            let x = f32s(r["x"].as_str().expect("x"));
            let want = f32s(r["quantized"].as_str().expect("quantized"));
            let mut got = vec![0.0f32; x.len()];
            q.apply(&x, cols, &mut got);
            let label = format!("{} {}", r["fixture"], r["layer"]);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(g.to_bits() == w.to_bits(), "{label}: value {i} ({}) -> {g}, compressed-tensors {w}", x[i]);
            }
        }
    }

    #[test]
    fn fp8_groups_and_asymmetric_int8() {
        let q = quant(ActivationType::Fp8E4M3, Scales::Group(2), true);
        let x = [448.0f32, 1.0, -3.0, 0.001];
        let mut out = [0.0f32; 4];
        q.apply(&x, 4, &mut out);
        assert_eq!(&out[..2], &[448.0, 1.0], "scale 1 for the first group");
        let s = 3.0f32 / 448.0;
        assert_eq!(out[2], round_e4m3(-3.0 / s) * s);
        assert_eq!(out[3], round_e4m3(0.001 / s) * s);
        // Asymmetric: range [min(x, 0), max(x, 0)] over 255 steps, zero point rounded.
        let a = quant(ActivationType::Int8, Scales::Token, false);
        let x = [0.5f32, 2.0, 1.25];
        let mut out = [0.0f32; 3];
        a.apply(&x, 3, &mut out);
        let scale = 2.0f32 / 255.0;
        let zero = (-128.0f32 - 0.0 / scale).clamp(-128.0, 127.0).round_ties_even();
        let want: Vec<f32> =
            x.iter().map(|&v| ((v / scale + zero).clamp(-128.0, 127.0).round_ties_even() - zero) * scale).collect();
        assert_eq!(out.to_vec(), want);
        // Static: the stored scale.
        let st = quant(ActivationType::Int8, Scales::Static(0.5), true);
        let mut out = [0.0f32; 3];
        st.apply(&[0.74, 0.76, 1000.0], 3, &mut out);
        assert_eq!(out, [0.5, 1.0, 63.5]);
    }
}
