//! Gemma 4 (`Gemma4ForCausalLM`, the text model; `model_type` `gemma4_text`; and the language
//! model of `Gemma4ForConditionalGeneration`): Gemma 3's sandwich block and 5:1 sliding/global
//! layers, with plain `w` RMSNorms (no `1 + w`), an unscaled value norm, attention scores not
//! scaled (the q norm does it), global layers with their own head width and KV heads and a
//! proportional RoPE, and, in the small sizes, per-layer input embeddings, keys and values
//! shared by the last layers, and a double-wide MLP on those layers; with `enable_moe_block`
//! (26B-A4B), routed experts beside every layer's MLP.
//!
//! A layer, top to bottom (`x`: the residual stream, `(n, hidden)`):
//! 1. `h = input_layernorm(x)`; `q (n, heads · head_dim)`, per-head `q_norm`, RoPE (local
//!    table on sliding layers, the global proportional one on full layers); keys and values
//!    `(n, kv_heads · head_dim)` from `k_proj` and `v_proj` (or `k_proj` alone for both when
//!    `attention_k_eq_v`, on full layers), per-head `k_norm` and RoPE on keys, `v_norm`
//!    (no weight) on values; or none of these on a layer that reuses an earlier layer's keys
//!    and values; attention (scale 1) over the window or everything; `o_proj` → `(n, hidden)`;
//!    `x += post_attention_layernorm(h)`.
//! 2. `h = pre_feedforward_layernorm(x)`; `down(gelu_tanh(gate(h)) · up(h))`;
//!    `x += post_feedforward_layernorm(h)`. With experts: `h = post_feedforward_layernorm_1(h)
//!    + post_feedforward_layernorm_2(Σ_e w_e · expert_e(pre_feedforward_layernorm_2(x)))`,
//!    routed from `x` itself (normed without a weight, times `router.scale` and
//!    `hidden^-0.5`; softmax, top k, renormalised, times `router.per_expert_scale`), then
//!    `x += post_feedforward_layernorm(h)`.
//! 3. With per-layer inputs `p (n, width)` for this layer: `g = gelu_tanh(per_layer_input_gate(x))
//!    · p` `(n, width)`; `x += post_per_layer_input_norm(per_layer_projection(g))`.
//! 4. `x *= layer_scalar`.
//!
//! Before the layers, the per-layer inputs of every layer at once `(n, layers · width)`:
//! `(rmsnorm(per_layer_model_projection(e) / √hidden) + embed_tokens_per_layer(ids) · √width) / √2`
//! per layer, with `e` the scaled embedding.

use serde_json::{Map, Value};

use super::{
    Activation, Defaults, ExpertActivation, Family, FfnKind, LLAMA_DEFAULTS, LayerRope, MoeDefaults, NormKind,
    NormPlacement, PerLayerInput, QkNorm, Routing,
};
use crate::arch::{
    EMBED_HEAD, GEMMA4_EXPERTS, LAYER_SCALAR, MLP, PER_LAYER_INPUTS, SANDWICH_NORMS, SHARED_KV_ATTENTION,
    SHARED_KV_BIAS,
};
use crate::config::{HfConfig, ModelConfig, raw_bool, raw_str, raw_u64};
use crate::error::{KylinError, Result};

const GLOBAL_THETA: f64 = 1_000_000.0;
const LOCAL_THETA: f64 = 10_000.0;

pub const FAMILY: Family = Family {
    hf_name: "Gemma4ForCausalLM",
    model_type: "gemma4_text",
    multimodal: Some("Gemma4ForConditionalGeneration"),
    about: "global layers of their own head width and RoPE, per-layer inputs, shared KV, layer scalars",
    // Gemma4TextConfig(max_position_embeddings=131072, head_dim=256, tie_word_embeddings=True).
    defaults: Defaults {
        max_position_embeddings: 131_072,
        head_dim: Some(256),
        rope_theta: GLOBAL_THETA,
        tie_word_embeddings: true,
        ..LLAMA_DEFAULTS
    },
    resolve,
    tensors: &[
        EMBED_HEAD,
        SANDWICH_NORMS,
        SHARED_KV_ATTENTION,
        SHARED_KV_BIAS,
        MLP,
        PER_LAYER_INPUTS,
        LAYER_SCALAR,
        GEMMA4_EXPERTS,
    ],
};

fn resolve(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    match raw_str(hf, "use_bidirectional_attention")?.as_deref() {
        None | Some("vision") => {}
        Some(other) => {
            return Err(KylinError::operator_unsupported(format!(
                "config.json sets use_bidirectional_attention to '{other}' (an embedding model); Kylin runs Gemma 4 as a causal language model"
            )));
        }
    }
    let key = if hf.raw.contains_key("hidden_activation") { "hidden_activation" } else { "hidden_act" };
    super::activation(hf, key, Activation::GeluTanh, c)?;
    hf.attention_bias_or_default(c);
    let embedding_scale = (c.hidden_size as f64).sqrt() as f32 as f64;
    let final_softcap = super::nullable_positive(hf, "final_logit_softcapping", None, c)?;
    let d = &mut c.decoder;
    d.norm = NormKind::Rms;
    d.attention_norms = NormPlacement::PreAndPost;
    d.mlp_norms = NormPlacement::PreAndPost;
    d.qk_norm = QkNorm::PerHead;
    d.value_norm = true;
    d.layer_scalar = true;
    d.embedding_scale = embedding_scale;
    // The q and k norms scale the scores; transformers sets `scaling = 1.0`.
    d.attention_scale = 1.0;
    d.final_softcap = final_softcap;

    layer_types(hf, c)?;
    layer_sizes(hf, c)?;
    kv_sharing(hf, c)?;
    ropes(hf, c)?;
    per_layer_inputs(hf, c)?;
    experts(hf, c)
}

/// `enable_moe_block`: every layer runs routed experts beside its MLP (the 26B-A4B model):
/// `num_experts`, `top_k_experts` and `moe_intermediate_size` are then required.
fn experts(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    if raw_bool(hf, "enable_moe_block")? != Some(true) {
        return Ok(());
    }
    for key in ["num_experts", "top_k_experts", "moe_intermediate_size"] {
        if raw_u64(hf, key)?.is_none() {
            return Err(KylinError::config_invalid(format!(
                "config.json sets enable_moe_block but not '{key}'; Gemma 4's experts need it"
            )));
        }
    }
    let defaults =
        MoeDefaults { num_experts: 0, top_k: 0, width_key: "moe_intermediate_size", width: 0, normalize: None };
    let mut moe = super::moe_fields(hf, c, &defaults)?;
    moe.routing = Routing::Gemma4;
    moe.activation = match c.decoder.activation {
        Activation::Silu => ExpertActivation::Silu,
        Activation::GeluTanh => ExpertActivation::GeluTanh,
    };
    c.decoder.moe = Some(moe);
    for layer in &mut c.decoder.layers {
        layer.ffn = FfnKind::DenseAndMoe;
    }
    Ok(())
}

/// The sliding and full layers: `layer_types`, else five sliding to one full; the last layer
/// is always full (transformers forces it, with a warning). The window defaults to 512.
fn layer_types(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let window = if hf.sliding_window_present { super::sliding_window(hf)? } else { Some(512) };
    if window.is_none() && !hf.sliding_window_present {
        c.defaulted.push("sliding_window".into());
    }
    let n = c.num_layers;
    let mut windows = match &hf.layer_types {
        Some(types) => super::windows_from_layer_types(types, n, window)?,
        None => {
            c.defaulted.push("layer_types".into());
            (0..n).map(|i| if (i + 1) % 6 != 0 { window } else { None }).collect()
        }
    };
    if let Some(last) = windows.last_mut() {
        *last = None;
    }
    for (layer, w) in c.decoder.layers.iter_mut().zip(windows) {
        layer.window = w;
    }
    Ok(())
}

/// The global layers' head width and KV heads: `per_layer_config` overrides by layer index
/// (transformers 5.24's layout) when written, else `global_head_dim` (default 512) and, with
/// `attention_k_eq_v`, `num_global_key_value_heads` on every full-attention layer (what
/// `Gemma4TextConfig.__post_init__` derives). `attention_k_eq_v` makes the full layers' values
/// their keys' projection.
fn layer_sizes(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let k_eq_v = raw_bool(hf, "attention_k_eq_v")?.unwrap_or_else(|| {
        c.defaulted.push("attention_k_eq_v".into());
        false
    });
    let overrides: Vec<(usize, Option<usize>, Option<usize>)> = match hf.raw.get("per_layer_config") {
        Some(Value::Object(per_layer)) => per_layer_overrides(per_layer, c.num_layers)?,
        Some(Value::Null) | None => {
            let global_head_dim = match raw_u64(hf, "global_head_dim")? {
                Some(v) => positive(v, "global_head_dim")?,
                None => 512,
            };
            let global_kv_heads = match raw_u64(hf, "num_global_key_value_heads")? {
                Some(v) if k_eq_v => Some(positive(v, "num_global_key_value_heads")?),
                _ => None,
            };
            c.decoder
                .layers
                .iter()
                .enumerate()
                .filter(|(_, l)| l.window.is_none())
                .map(|(i, _)| (i, Some(global_head_dim), global_kv_heads))
                .collect()
        }
        Some(other) => return Err(crate::config::bad("per_layer_config", "an object", other)),
    };
    for (i, head_dim, kv_heads) in overrides {
        let layer = &mut c.decoder.layers[i];
        if let Some(h) = head_dim {
            layer.head_dim = h;
        }
        if let Some(k) = kv_heads {
            if !c.num_heads.is_multiple_of(k) {
                return Err(KylinError::config_invalid(format!(
                    "config.json: layer {i} has {k} key-value heads, which does not divide num_attention_heads={}",
                    c.num_heads
                )));
            }
            layer.num_kv_heads = k;
        }
    }
    for layer in &mut c.decoder.layers {
        layer.value_is_key = k_eq_v && layer.window.is_none();
    }
    Ok(())
}

/// One layer's overrides: its index, `head_dim` and `num_key_value_heads` if given.
type LayerOverride = (usize, Option<usize>, Option<usize>);

/// `per_layer_config`: `{"5": {"head_dim": 512, "num_key_value_heads": 2}, ...}`; any other
/// override is `OPERATOR_UNSUPPORTED` naming it.
fn per_layer_overrides(per_layer: &Map<String, Value>, num_layers: usize) -> Result<Vec<LayerOverride>> {
    let mut out = Vec::new();
    for (key, value) in per_layer {
        let field = |k: &str| format!("per_layer_config.{key}.{k}");
        let index = key.parse::<usize>().ok().filter(|&i| i < num_layers).ok_or_else(|| {
            crate::config::bad(
                "per_layer_config",
                &format!("keyed by layer indices below {num_layers}"),
                &Value::String(key.clone()),
            )
        })?;
        let Value::Object(entries) = value else {
            return Err(crate::config::bad(&format!("per_layer_config.{key}"), "an object", value));
        };
        let mut head_dim = None;
        let mut kv_heads = None;
        for (name, v) in entries {
            let number = || -> Result<usize> {
                v.as_u64()
                    .filter(|&n| n > 0 && n <= 1 << 20)
                    .map(|n| n as usize)
                    .ok_or_else(|| crate::config::bad(&field(name), "a positive integer", v))
            };
            match name.as_str() {
                "head_dim" => head_dim = Some(number()?),
                "num_key_value_heads" => kv_heads = Some(number()?),
                other => {
                    return Err(KylinError::operator_unsupported(format!(
                        "config.json {} overrides '{other}' for one layer; Kylin varies head_dim and num_key_value_heads per layer",
                        field(other)
                    )));
                }
            }
        }
        out.push((index, head_dim, kv_heads));
    }
    Ok(out)
}

fn positive(v: u64, name: &str) -> Result<usize> {
    match usize::try_from(v) {
        Ok(n) if n > 0 && n <= 1 << 20 => Ok(n),
        _ => Err(KylinError::config_invalid(format!("config.json field '{name}' is {v}; it must be a positive size"))),
    }
}

/// `num_kv_shared_layers`: the last that many layers reuse the keys and values of the last
/// earlier layer of their own type; with `use_double_wide_mlp` their MLP is twice as wide
/// (`Gemma4TextConfig.kv_sharing_modes`).
fn kv_sharing(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let shared = raw_u64(hf, "num_kv_shared_layers")?.unwrap_or(0) as usize;
    let double_wide = raw_bool(hf, "use_double_wide_mlp")?.unwrap_or(false);
    if shared == 0 {
        return Ok(());
    }
    let n = c.num_layers;
    if shared >= n {
        return Err(KylinError::config_invalid(format!(
            "config.json field 'num_kv_shared_layers' is {shared}; with {n} layers at least one layer must compute its own keys and values"
        )));
    }
    let first_shared = n - shared;
    for i in first_shared..n {
        let sliding = c.decoder.layers[i].window.is_some();
        let source = (0..first_shared).rev().find(|&j| c.decoder.layers[j].window.is_some() == sliding).ok_or_else(|| {
            KylinError::config_invalid(format!(
                "config.json: layer {i} ({}) shares keys and values, but no earlier layer of that type computes them (num_kv_shared_layers={shared})",
                if sliding { "sliding_attention" } else { "full_attention" }
            ))
        })?;
        let src = c.decoder.layers[source];
        if (src.head_dim, src.num_kv_heads) != (c.decoder.layers[i].head_dim, c.decoder.layers[i].num_kv_heads) {
            return Err(KylinError::config_invalid(format!(
                "config.json: layer {i} reuses the keys and values of layer {source}, whose heads differ in size"
            )));
        }
        let layer = &mut c.decoder.layers[i];
        layer.kv_source = Some(source);
        layer.value_is_key = src.value_is_key;
        if double_wide {
            layer.intermediate = 2 * c.intermediate_size;
        }
    }
    Ok(())
}

/// RoPE per layer type: `rope_parameters: {sliding_attention: {...}, full_attention: {...}}`,
/// defaulting to the default RoPE with base 10 000 on sliding layers and the proportional one
/// (a quarter of the frequencies, base 1 000 000) on full layers. Full layers' tables are built
/// for their own head width.
fn ropes(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let per_type = |k: &str| -> Option<&Map<String, Value>> {
        match hf.rope_parameters.as_ref()?.get(k) {
            Some(Value::Object(m)) => Some(m),
            _ => None,
        }
    };
    let mut full_default = Map::new();
    full_default.insert("rope_type".into(), Value::String("proportional".into()));
    full_default.insert("partial_rotary_factor".into(), serde_json::json!(0.25));
    let sliding_default = Map::new();
    if per_type("full_attention").is_none() {
        c.defaulted.push("rope_parameters.full_attention".into());
    }
    if per_type("sliding_attention").is_none() {
        c.defaulted.push("rope_parameters.sliding_attention".into());
    }
    let max = c.max_position_embeddings;
    let global = hf.resolve_rope_params(
        per_type("full_attention").unwrap_or(&full_default),
        "rope_parameters.full_attention",
        None,
        GLOBAL_THETA,
        max,
        &mut c.defaulted,
    )?;
    let local = hf.resolve_rope_params(
        per_type("sliding_attention").unwrap_or(&sliding_default),
        "rope_parameters.sliding_attention",
        None,
        LOCAL_THETA,
        max,
        &mut c.defaulted,
    )?;
    c.rope = global;
    c.decoder.local_rope = Some(local);
    for layer in &mut c.decoder.layers {
        layer.rope = if layer.window.is_some() { LayerRope::Local } else { LayerRope::Global };
    }
    Ok(())
}

/// `hidden_size_per_layer_input` (default 256; 0 or null turns the per-layer inputs off),
/// `vocab_size_per_layer_input` (default 262 144) and `pad_token_id` (default 0), the row an
/// image's tokens read, which must be a row of both embeddings.
fn per_layer_inputs(hf: &HfConfig, c: &mut ModelConfig) -> Result<()> {
    let width = match hf.raw.get("hidden_size_per_layer_input") {
        None => {
            c.defaulted.push("hidden_size_per_layer_input".into());
            256
        }
        Some(Value::Null) => 0,
        Some(_) => raw_u64(hf, "hidden_size_per_layer_input")?.unwrap_or(0) as usize,
    };
    if width == 0 {
        return Ok(());
    }
    let vocab = match raw_u64(hf, "vocab_size_per_layer_input")? {
        Some(v) => positive(v, "vocab_size_per_layer_input")?,
        None => {
            c.defaulted.push("vocab_size_per_layer_input".into());
            262_144
        }
    };
    if width > 1 << 16 || width.checked_mul(c.num_layers).is_none() {
        return Err(KylinError::config_invalid(format!(
            "config.json field 'hidden_size_per_layer_input' is {width}, which is implausibly large"
        )));
    }
    let pad_row = match raw_u64(hf, "pad_token_id")? {
        Some(id) => id,
        None => {
            c.defaulted.push("pad_token_id".into());
            0
        }
    };
    if pad_row >= vocab.min(c.vocab_size) as u64 {
        return Err(KylinError::config_invalid(format!(
            "config.json field 'pad_token_id' is {pad_row}, not a row of the embeddings (vocab_size {}, \
             vocab_size_per_layer_input {vocab}): Gemma 4 gives an image's tokens that row's per-layer input",
            c.vocab_size
        )));
    }
    c.decoder.per_layer_input = Some(PerLayerInput { width, vocab, pad_row: pad_row as usize });
    Ok(())
}
