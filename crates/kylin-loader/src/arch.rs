//! Declarative tensor tables: which checkpoint tensor fills which role, with which shape.
//!
//! One table per architecture, assembled from shared groups (every entry exists once): the
//! common decoder block, q/k/v biases, the output-projection bias, MLP biases and Qwen3's per-head
//! q/k norms. Names use `{layer}` for the layer index. Shapes are functions of [`ModelConfig`].
//! Binding checks every required tensor (listing *all* missing ones at once), every shape and
//! every dtype, and reports the tensors the table did not use.
//!
//! A user tensor-map file (`LoadOptions::tensor_map`) renames entries for a checkpoint that
//! stores the same weights under other names:
//!
//! ```json
//! {"tensors": {"model.layers.{layer}.self_attn.q_proj.weight": "blocks.{layer}.attn.wq",
//!              "model.embed_tokens.weight": "tok_embeddings.weight"}}
//! ```
//!
//! Keys are table names (as listed by [`table_names`]); values are the names in the checkpoint.
//! A key with `{layer}` needs a value with `{layer}`. Any other shape of file, an unknown key or
//! a missing `{layer}` is `MAPPING_INVALID`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde_json::Value;

use crate::config::{Architecture, ModelConfig, StoredQuantization};
use crate::error::{KylinError, Result};
use crate::safetensors_file::TensorIndex;
use crate::tensor::DType;
use crate::tensor::WeightTensor;
use crate::weights::{HeadBinding, LayerWeights, ModelWeights};

/// A dimension named after the config value it comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    Vocab,
    Hidden,
    /// `num_attention_heads * head_dim`.
    QDim,
    /// `num_key_value_heads * head_dim`.
    KvDim,
    HeadDim,
    Intermediate,
}

impl Dim {
    fn value(self, c: &ModelConfig) -> usize {
        match self {
            Dim::Vocab => c.vocab_size,
            Dim::Hidden => c.hidden_size,
            Dim::QDim => c.num_heads * c.head_dim,
            Dim::KvDim => c.num_kv_heads * c.head_dim,
            Dim::HeadDim => c.head_dim,
            Dim::Intermediate => c.intermediate_size,
        }
    }

    fn explain(self, c: &ModelConfig) -> String {
        match self {
            Dim::Vocab => format!("vocab_size={}", c.vocab_size),
            Dim::Hidden => format!("hidden_size={}", c.hidden_size),
            Dim::QDim => format!("num_attention_heads={} * head_dim={}", c.num_heads, c.head_dim),
            Dim::KvDim => format!("num_key_value_heads={} * head_dim={}", c.num_kv_heads, c.head_dim),
            Dim::HeadDim => format!("head_dim={}", c.head_dim),
            Dim::Intermediate => format!("intermediate_size={}", c.intermediate_size),
        }
    }
}

/// When an entry is required.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cond {
    Always,
    QkvBias,
    OBias,
    MlpBias,
    QkNorm,
    /// Only when the head is not tied (`lm_head.weight`).
    Untied,
}

impl Cond {
    fn holds(self, c: &ModelConfig) -> bool {
        match self {
            Cond::Always => true,
            Cond::QkvBias => c.qkv_bias,
            Cond::OBias => c.o_bias,
            Cond::MlpBias => c.mlp_bias,
            Cond::QkNorm => c.qk_norm,
            Cond::Untied => !c.tie_word_embeddings,
        }
    }
}

/// The role a tensor plays in [`ModelWeights`] / [`LayerWeights`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Role {
    Embed,
    FinalNorm,
    LmHead,
    AttnNorm,
    QProj,
    KProj,
    VProj,
    OProj,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
    MlpNorm,
    GateProj,
    UpProj,
    DownProj,
    GateBias,
    UpBias,
    DownBias,
}

impl Role {
    /// The matrices of the matrix products (which a quantized checkpoint stores quantized).
    pub fn is_matrix(self) -> bool {
        matches!(
            self,
            Role::LmHead
                | Role::QProj
                | Role::KProj
                | Role::VProj
                | Role::OProj
                | Role::GateProj
                | Role::UpProj
                | Role::DownProj
        )
    }
}

/// One table entry.
#[derive(Debug, Clone, Copy)]
pub struct Spec {
    pub role: Role,
    /// The Hugging Face name; per-layer names contain `{layer}`.
    pub name: &'static str,
    pub shape: &'static [Dim],
    pub cond: Cond,
}

const fn spec(role: Role, name: &'static str, shape: &'static [Dim], cond: Cond) -> Spec {
    Spec { role, name, shape, cond }
}

use Dim::*;

/// Every decoder-only architecture here: embeddings, norms, attention and SwiGLU projections.
const COMMON: &[Spec] = &[
    spec(Role::Embed, "model.embed_tokens.weight", &[Vocab, Hidden], Cond::Always),
    spec(Role::FinalNorm, "model.norm.weight", &[Hidden], Cond::Always),
    spec(Role::LmHead, "lm_head.weight", &[Vocab, Hidden], Cond::Untied),
    spec(Role::AttnNorm, "model.layers.{layer}.input_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::QProj, "model.layers.{layer}.self_attn.q_proj.weight", &[QDim, Hidden], Cond::Always),
    spec(Role::KProj, "model.layers.{layer}.self_attn.k_proj.weight", &[KvDim, Hidden], Cond::Always),
    spec(Role::VProj, "model.layers.{layer}.self_attn.v_proj.weight", &[KvDim, Hidden], Cond::Always),
    spec(Role::OProj, "model.layers.{layer}.self_attn.o_proj.weight", &[Hidden, QDim], Cond::Always),
    spec(Role::MlpNorm, "model.layers.{layer}.post_attention_layernorm.weight", &[Hidden], Cond::Always),
    spec(Role::GateProj, "model.layers.{layer}.mlp.gate_proj.weight", &[Intermediate, Hidden], Cond::Always),
    spec(Role::UpProj, "model.layers.{layer}.mlp.up_proj.weight", &[Intermediate, Hidden], Cond::Always),
    spec(Role::DownProj, "model.layers.{layer}.mlp.down_proj.weight", &[Hidden, Intermediate], Cond::Always),
];

const QKV_BIAS: &[Spec] = &[
    spec(Role::QBias, "model.layers.{layer}.self_attn.q_proj.bias", &[QDim], Cond::QkvBias),
    spec(Role::KBias, "model.layers.{layer}.self_attn.k_proj.bias", &[KvDim], Cond::QkvBias),
    spec(Role::VBias, "model.layers.{layer}.self_attn.v_proj.bias", &[KvDim], Cond::QkvBias),
];

const O_BIAS: &[Spec] = &[spec(Role::OBias, "model.layers.{layer}.self_attn.o_proj.bias", &[Hidden], Cond::OBias)];

const MLP_BIAS: &[Spec] = &[
    spec(Role::GateBias, "model.layers.{layer}.mlp.gate_proj.bias", &[Intermediate], Cond::MlpBias),
    spec(Role::UpBias, "model.layers.{layer}.mlp.up_proj.bias", &[Intermediate], Cond::MlpBias),
    spec(Role::DownBias, "model.layers.{layer}.mlp.down_proj.bias", &[Hidden], Cond::MlpBias),
];

const QK_NORM: &[Spec] = &[
    spec(Role::QNorm, "model.layers.{layer}.self_attn.q_norm.weight", &[HeadDim], Cond::QkNorm),
    spec(Role::KNorm, "model.layers.{layer}.self_attn.k_norm.weight", &[HeadDim], Cond::QkNorm),
];

/// The registry: each architecture's table as a list of groups.
fn groups(arch: Architecture) -> &'static [&'static [Spec]] {
    match arch {
        Architecture::Qwen3 => &[COMMON, QKV_BIAS, O_BIAS, QK_NORM],
        Architecture::Qwen2 => &[COMMON, QKV_BIAS],
        Architecture::Llama => &[COMMON, QKV_BIAS, O_BIAS, MLP_BIAS],
        Architecture::Mistral => &[COMMON],
    }
}

/// The table of an architecture.
pub fn table(arch: Architecture) -> Vec<Spec> {
    groups(arch).iter().flat_map(|g| g.iter().copied()).collect()
}

/// The checkpoint name of `role` in `arch`'s table, with `{layer}` filled in for per-layer
/// roles; `None` if the table has no such role.
pub fn tensor_name(arch: Architecture, role: Role, layer: usize) -> Option<String> {
    let spec = table(arch).into_iter().find(|s| s.role == role)?;
    Some(spec.name.replace("{layer}", &layer.to_string()))
}

/// The table names a tensor-map file may use for `arch`.
pub fn table_names(arch: Architecture) -> Vec<&'static str> {
    table(arch).iter().map(|s| s.name).collect()
}

/// A parsed tensor-map file: table name → checkpoint name.
#[derive(Debug, Clone, Default)]
pub struct TensorMap {
    pub renames: BTreeMap<String, String>,
}

impl TensorMap {
    /// Reads and checks a tensor-map file against `arch`'s table.
    pub fn load(path: &Path, arch: Architecture) -> Result<TensorMap> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            let mut err = KylinError::io(path, "cannot read tensor map", &e);
            if err.code != crate::error::ErrorCode::FileNotFound {
                err.code = crate::error::ErrorCode::MappingInvalid;
            }
            err
        })?;
        Self::parse(&text, arch).map_err(|e| e.at(path))
    }

    /// Parses tensor-map JSON; every problem is `MAPPING_INVALID`.
    pub fn parse(text: &str, arch: Architecture) -> Result<TensorMap> {
        let invalid = |what: String| KylinError::mapping_invalid(format!("tensor map: {what}"));
        let value: Value = serde_json::from_str(text).map_err(|e| invalid(format!("not valid JSON ({e})")))?;
        let Value::Object(top) = value else {
            return Err(invalid("expected an object {\"tensors\": {...}}".into()));
        };
        if let Some(k) = top.keys().find(|k| k.as_str() != "tensors") {
            return Err(invalid(format!("unknown key '{k}'; the only key is 'tensors'")));
        }
        let Some(Value::Object(entries)) = top.get("tensors") else {
            return Err(invalid("'tensors' must be an object of table name -> checkpoint name".into()));
        };
        let known = table_names(arch);
        let mut renames = BTreeMap::new();
        for (key, v) in entries {
            if !known.contains(&key.as_str()) {
                return Err(invalid(format!(
                    "'{key}' is not a table name of {}; table names: {}",
                    arch.hf_name(),
                    known.join(", ")
                )));
            }
            let to = v
                .as_str()
                .filter(|s| !s.is_empty())
                .ok_or_else(|| invalid(format!("the value for '{key}' must be a non-empty checkpoint tensor name")))?;
            if key.contains("{layer}") != to.contains("{layer}") {
                return Err(invalid(format!(
                    "'{key}' -> '{to}': a per-layer name needs '{{layer}}' on both sides, a global one on neither"
                )));
            }
            renames.insert(key.clone(), to.to_string());
        }
        Ok(TensorMap { renames })
    }

    fn name_for(&self, table_name: &str) -> String {
        self.renames.get(table_name).cloned().unwrap_or_else(|| table_name.to_string())
    }
}

/// The result of binding: the weights and the checkpoint tensors nobody asked for.
pub(crate) struct Bound {
    pub weights: ModelWeights,
    pub unused: Vec<String>,
}

fn shape_text(shape: &[usize]) -> String {
    format!("[{}]", shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "))
}

/// Takes a bound required role out of `found`.
pub(crate) fn take(
    found: &mut BTreeMap<(usize, Role), WeightTensor>,
    layer: usize,
    role: Role,
) -> Result<WeightTensor> {
    found.remove(&(layer, role)).ok_or_else(|| {
        // Unreachable by construction: every required role was checked before this is called.
        KylinError::tensor_missing(format!("internal: role {role:?} of layer {layer} was not bound"))
    })
}

/// Binds every role of `config.architecture`'s table to a tensor of `index`.
pub(crate) fn bind(config: &ModelConfig, index: &TensorIndex, map: &TensorMap) -> Result<Bound> {
    let specs = table(config.architecture);
    let mut missing: Vec<String> = Vec::new();
    let mut shape_errors: Vec<String> = Vec::new();
    let mut dtype_errors: Vec<String> = Vec::new();
    let mut used: BTreeSet<String> = BTreeSet::new();
    // Role per layer (usize::MAX for global roles) -> view.
    let mut found: BTreeMap<(usize, Role), WeightTensor> = BTreeMap::new();
    // Weight name -> its scale plane, for a stored-quantized checkpoint.
    let mut scales: BTreeMap<String, WeightTensor> = BTreeMap::new();
    // Weight name -> its checked tensors, for a published quantized checkpoint.
    let mut published: BTreeMap<String, crate::published::PublishedMatrix> = BTreeMap::new();

    let mut check = |spec: &Spec, layer: Option<usize>, found: &mut BTreeMap<(usize, Role), WeightTensor>| {
        let template = map.name_for(spec.name);
        let name = match layer {
            Some(i) => template.replace("{layer}", &i.to_string()),
            None => template,
        };
        if let Some(q) = config.published.as_ref().filter(|_| spec.role.is_matrix() && spec.cond.holds(config)) {
            let module = name.strip_suffix(".weight").unwrap_or(&name).to_string();
            if !q.ignores(&module) {
                // A published quantized matrix: its tensors, as its config and shape imply.
                let expected: Vec<usize> = spec.shape.iter().map(|d| d.value(config)).collect();
                let mut read = Vec::new();
                let bound = crate::published::bind_matrix(q, index, &module, expected[0], expected[1], &mut read);
                used.extend(read);
                match bound {
                    Ok(m) => {
                        // Static activation scales are not used: Kylin quantizes activations
                        // dynamically (finer than a stored per-tensor scale).
                        for extra in ["input_scale", "input_zero_point"] {
                            let n = format!("{module}.{extra}");
                            if index.raw(&n).is_some() {
                                used.insert(n);
                            }
                        }
                        found.insert((layer.unwrap_or(usize::MAX), spec.role), m.values.clone());
                        published.insert(name, m);
                    }
                    Err(crate::published::BindProblem::Missing(n)) => missing.push(n),
                    Err(crate::published::BindProblem::Shape(e)) => shape_errors.push(e),
                    Err(crate::published::BindProblem::DType(e)) => dtype_errors.push(e),
                }
                return;
            }
        }
        let Some(raw) = index.raw(&name) else {
            if spec.cond.holds(config) {
                missing.push(name);
            }
            return;
        };
        if !spec.cond.holds(config) {
            // Present but not wanted (e.g. a bias the config turns off): left for `unused`.
            return;
        }
        used.insert(name.clone());
        let expected: Vec<usize> = spec.shape.iter().map(|d| d.value(config)).collect();
        if let Some(q) = config.quantization.filter(|_| spec.role.is_matrix()) {
            // A stored-quantized matrix: its two planes, with the shapes and dtypes the
            // matrix's shape implies.
            // A `q4_k-packed` checkpoint stores each matrix in Q4_K (U8 scales) or Q8_0 (F16
            // scales), as `kylin quantize --to q4_k` chose; a `q8_0-packed` one only Q8_0.
            let (rows, cols) = (expected[0], expected[1]);
            let why = || spec.shape.iter().map(|d| d.explain(config)).collect::<Vec<_>>().join(", ");
            let scale_name = format!("{name}_scale");
            let q4k =
                q == StoredQuantization::KylinQ4K && index.raw(&scale_name).is_some_and(|r| r.dtype == Some(DType::U8));
            let (format, unit) = if q4k { ("Q4_K", 64) } else { ("Q8_0", 32) };
            if cols == 0 || !cols.is_multiple_of(unit) {
                shape_errors.push(format!(
                    "tensor '{name}': {format} needs columns in multiples of {unit}; the matrix has {cols} ({})",
                    why()
                ));
                return;
            }
            let groups = rows.div_ceil(16);
            let planes: [(&String, Vec<usize>, DType); 2] = if q4k {
                let scale_bytes = 64 * cols.div_ceil(256) + cols;
                [(&name, vec![groups, cols * 8], DType::U8), (&scale_name, vec![groups, scale_bytes], DType::U8)]
            } else {
                let blocks = cols / 32;
                [(&name, vec![groups, blocks, 512], DType::U8), (&scale_name, vec![groups, blocks, 16], DType::F16)]
            };
            let mut views: [Option<WeightTensor>; 2] = [None, None];
            for (slot, (plane, shape, dtype)) in views.iter_mut().zip(planes) {
                let Some(raw) = index.raw(plane) else {
                    missing.push(plane.clone());
                    return;
                };
                used.insert(plane.clone());
                if raw.shape != shape {
                    shape_errors.push(format!(
                        "tensor '{plane}' has shape {}; expected {} ({format} planes of a [{rows}, {cols}] matrix: {})",
                        shape_text(&raw.shape),
                        shape_text(&shape),
                        why()
                    ));
                    return;
                }
                match (raw.dtype, index.view(plane)) {
                    (Some(dt), Some(view)) if dt == dtype => *slot = Some(view),
                    _ => {
                        dtype_errors.push(format!(
                            "tensor '{plane}' is stored as {}; a {format} plane is {}",
                            raw.dtype_name,
                            dtype.as_str()
                        ));
                        return;
                    }
                }
            }
            // Each plane either filled its slot or returned above.
            let [Some(quants), Some(scale)] = views else { return };
            scales.insert(name.clone(), scale);
            found.insert((layer.unwrap_or(usize::MAX), spec.role), quants);
            return;
        }
        if raw.shape != expected {
            let why: Vec<String> = spec.shape.iter().map(|d| d.explain(config)).collect();
            shape_errors.push(format!(
                "tensor '{name}' has shape {}; expected {} (from {})",
                shape_text(&raw.shape),
                shape_text(&expected),
                why.join(", ")
            ));
            return;
        }
        match (raw.dtype, index.view(&name)) {
            (Some(dt), Some(view)) if dt.is_float() => {
                found.insert((layer.unwrap_or(usize::MAX), spec.role), view);
            }
            _ => dtype_errors.push(format!(
                "tensor '{name}' is stored as {}; the engine computes on BF16, F16 or F32 only",
                raw.dtype_name
            )),
        }
    };
    for spec in &specs {
        if spec.name.contains("{layer}") {
            for i in 0..config.num_layers {
                check(spec, Some(i), &mut found);
            }
        } else {
            check(spec, None, &mut found);
        }
    }

    if !missing.is_empty() {
        let mut msg =
            format!("{} required tensors are missing from the checkpoint: {}", missing.len(), missing.join(", "));
        if missing.iter().any(|n| n == &map.name_for("lm_head.weight")) {
            msg.push_str(
                "; tie_word_embeddings is false so the head needs its own lm_head.weight \
                 (if the model shares the embedding, set \"tie_word_embeddings\": true in config.json)",
            );
        } else if map.renames.is_empty() {
            msg.push_str("; if the checkpoint names them differently, pass a tensor map file");
        }
        return Err(KylinError::tensor_missing(msg));
    }
    if !shape_errors.is_empty() {
        return Err(KylinError::tensor_shape_mismatch(shape_errors.join("; ")));
    }
    if !dtype_errors.is_empty() {
        return Err(KylinError::tensor_dtype_unsupported(dtype_errors.join("; ")));
    }

    let lm_head_name = map.name_for("lm_head.weight");
    let embed_tokens = take(&mut found, usize::MAX, Role::Embed)?;
    let final_norm = take(&mut found, usize::MAX, Role::FinalNorm)?;
    let (lm_head, head) = if config.tie_word_embeddings {
        let reason = if index.raw(&lm_head_name).is_some() {
            used.insert(lm_head_name.clone());
            format!(
                "tie_word_embeddings is true; {lm_head_name} is present but ignored, as transformers does: \
                 the head uses the embedding matrix"
            )
        } else {
            "tie_word_embeddings is true: the head uses the embedding matrix".to_string()
        };
        (embed_tokens.clone(), HeadBinding { tied: true, reason })
    } else {
        (
            take(&mut found, usize::MAX, Role::LmHead)?,
            HeadBinding { tied: false, reason: format!("tie_word_embeddings is false: the head is {lm_head_name}") },
        )
    };
    let mut layers = Vec::with_capacity(config.num_layers);
    for i in 0..config.num_layers {
        let opt = |found: &mut BTreeMap<(usize, Role), WeightTensor>, role: Role| found.remove(&(i, role));
        let (q_bias, k_bias, v_bias, o_bias) = (
            opt(&mut found, Role::QBias),
            opt(&mut found, Role::KBias),
            opt(&mut found, Role::VBias),
            opt(&mut found, Role::OBias),
        );
        let (q_norm, k_norm) = (opt(&mut found, Role::QNorm), opt(&mut found, Role::KNorm));
        let (gate_bias, up_bias, down_bias) =
            (opt(&mut found, Role::GateBias), opt(&mut found, Role::UpBias), opt(&mut found, Role::DownBias));
        layers.push(LayerWeights {
            attn_norm: take(&mut found, i, Role::AttnNorm)?,
            q_proj: take(&mut found, i, Role::QProj)?,
            k_proj: take(&mut found, i, Role::KProj)?,
            v_proj: take(&mut found, i, Role::VProj)?,
            o_proj: take(&mut found, i, Role::OProj)?,
            q_bias,
            k_bias,
            v_bias,
            o_bias,
            q_norm,
            k_norm,
            mlp_norm: take(&mut found, i, Role::MlpNorm)?,
            gate_proj: take(&mut found, i, Role::GateProj)?,
            up_proj: take(&mut found, i, Role::UpProj)?,
            down_proj: take(&mut found, i, Role::DownProj)?,
            gate_bias,
            up_bias,
            down_bias,
        });
    }
    let unused: Vec<String> = index.names().filter(|n| !used.contains(*n)).map(str::to_string).collect();
    Ok(Bound { weights: ModelWeights { embed_tokens, final_norm, lm_head, head, layers, scales, published }, unused })
}
