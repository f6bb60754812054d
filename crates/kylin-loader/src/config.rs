//! `config.json` in both layouts, parsed faithfully, then resolved into a [`ModelConfig`] where
//! every value is decided.
//!
//! Published checkpoints put `rope_theta`, `rope_scaling` and `torch_dtype` at the top level;
//! transformers 5 writes `rope_parameters` and `dtype`. Both resolve to the same `ModelConfig`.

use serde::Serialize;

use crate::family::{DecoderSpec, Family};

/// An architecture Kylin's native engine runs: a handle to its [`Family`] in the registry
/// (`family/`), from `architectures[0]`.
#[derive(Clone, Copy)]
pub struct Architecture(&'static Family);

impl Architecture {
    pub const QWEN3: Architecture = Architecture(&crate::family::qwen3::FAMILY);
    pub const QWEN2: Architecture = Architecture(&crate::family::qwen2::FAMILY);
    pub const LLAMA: Architecture = Architecture(&crate::family::llama::FAMILY);
    pub const MISTRAL: Architecture = Architecture(&crate::family::mistral::FAMILY);

    /// Every supported `architectures[0]` value, for error messages and `inspect --architectures`.
    pub fn supported() -> Vec<&'static str> {
        crate::family::REGISTRY.iter().map(|f| f.hf_name).collect()
    }

    /// The Hugging Face class name, e.g. `Qwen3ForCausalLM`.
    pub fn hf_name(self) -> &'static str {
        self.0.hf_name
    }

    /// The family's registry entry.
    pub fn family(self) -> &'static Family {
        self.0
    }
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.0.hf_name == other.0.hf_name
    }
}

impl Eq for Architecture {}

impl std::hash::Hash for Architecture {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hf_name.hash(state)
    }
}

impl std::fmt::Debug for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0.hf_name)
    }
}

impl Serialize for Architecture {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.0.hf_name)
    }
}

/// How rotary position embeddings scale their frequencies, with every parameter resolved
/// (transformers' defaults filled in), exactly as `transformers.modeling_rope_utils` uses them.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    Default,
    Linear {
        factor: f64,
    },
    /// NTK-aware dynamic scaling: the base grows once the sequence exceeds
    /// `original_max_position_embeddings`.
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        /// The resolved attention scaling applied to cos/sin (transformers' `attention_factor`).
        attention_factor: f64,
        truncate: bool,
    },
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Gemma 4's `proportional` RoPE: the whole head is rotated (rotate-half over `head_dim`),
    /// with the frequencies `1 / base ** (2i / head_dim)` for the first
    /// `floor(partial_rotary_factor · head_dim / 2)` pairs and zero (no rotation) for the rest,
    /// all divided by `factor`.
    Proportional {
        factor: f64,
    },
    /// Phi-3's LongRoPE: per-frequency divisors, `short_factor` within the original context
    /// and `long_factor` beyond it, with cos/sin scaled by `attention_factor`.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_position_embeddings: usize,
        attention_factor: f64,
    },
}

/// Rotary embedding settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RopeConfig {
    pub theta: f64,
    /// Fraction of `head_dim` that is rotated (the first `head_dim · factor` dimensions, an
    /// even count; Phi-4-mini rotates 0.75).
    pub partial_rotary_factor: f64,
    pub scaling: RopeScaling,
    /// Multimodal RoPE (Qwen-VL): how the rotary frequencies split between an image token's
    /// time, row and column positions. Text tokens take their one position on every section.
    pub multimodal: Option<MultimodalRope>,
}

/// The multimodal RoPE's split of the frequencies (`mrope_section`: time, height, width).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MultimodalRope {
    pub sections: [usize; 3],
    /// Qwen3-VL and Qwen3.5 interleave the sections (frequency `i` is height when `i % 3 == 1`
    /// and `i < 3 · sections[1]`, width when `i % 3 == 2` and `i < 3 · sections[2]`, else time);
    /// Qwen2-VL lays them out one after another.
    pub interleaved: bool,
}

impl MultimodalRope {
    /// The axis (0 time, 1 height, 2 width) of each of `half` frequencies.
    pub fn axes(&self, half: usize) -> Vec<u8> {
        let [t, h, w] = self.sections;
        (0..half)
            .map(|i| {
                if self.interleaved {
                    match i % 3 {
                        1 if i < 3 * h => 1,
                        2 if i < 3 * w => 2,
                        _ => 0,
                    }
                } else if i < t {
                    0
                } else if i < t + h {
                    1
                } else {
                    2
                }
            })
            .collect()
    }
}

/// A model's configuration with every value decided: nothing here is optional because of the
/// file's layout. `defaulted` lists the fields that were not in `config.json`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub model_type: String,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope: RopeConfig,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (always for Qwen2; `attention_bias` for Llama/Mistral).
    pub qkv_bias: bool,
    /// The output projection carries a bias (`attention_bias` for Llama/Mistral).
    pub o_bias: bool,
    /// The MLP projections carry biases (`mlp_bias` for Llama).
    pub mlp_bias: bool,
    /// The activation as `config.json` names it (`silu`, `gelu_pytorch_tanh`).
    pub hidden_act: String,
    /// The decoder's blocks and constants, as the family decided them.
    pub decoder: DecoderSpec,
    /// The language model of this vision-language class is run (`text_config`; weights
    /// under `model.language_model.*` or `language_model.model.*`).
    pub multimodal: Option<String>,
    /// `dtype` / `torch_dtype` as declared, if any.
    pub declared_dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Fields that were absent and took their default, by config.json name.
    pub defaulted: Vec<String>,
    /// The checkpoint's stored quantization (`quantization_config`), if any.
    pub quantization: Option<StoredQuantization>,
    /// A published quantization (compressed-tensors, fine-grained FP8, GPTQ, AWQ), if
    /// `quantization_config` names one.
    pub published: Option<crate::published::PublishedQuantization>,
}

/// A quantization a checkpoint is stored in, from `config.json`'s `quantization_config`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum StoredQuantization {
    /// Written by `kylin quantize --to q8_0`: every linear layer and the head as two planes,
    /// `X.weight` (U8 `[groups of 16 rows, blocks of 32 columns, 512]`, Kylin's packed Q8_0
    /// quants) and `X.weight_scale` (F16 `[groups, blocks, 16]`); the embedding as stored.
    KylinQ8_0,
    /// Written by `kylin quantize --to q4_k`: each linear layer and the head as Kylin's packed
    /// Q4_K (`X.weight` U8 `[groups of 16 rows, cols · 8]`, `X.weight_scale` U8 `[groups, 64 ·
    /// super-blocks + cols]`, columns whole super-blocks of 256), packed Q5_0 (the same quants
    /// plane, `X.weight_scale` U8 `[groups, 3 · cols]`, other columns), packed Q6_0 (the same
    /// quants plane, `X.weight_scale` U8 `[groups, 5 · cols]`, where the recipe wants more
    /// bits) or packed Q8_0 (F16 scales, as above), as the Q4_K recipe chose; the embedding as
    /// stored.
    KylinQ4K,
}

impl StoredQuantization {
    /// The format of a `q4_k-packed` matrix of `cols` columns whose scales are U8 with
    /// `scale_cols` bytes per group of 16 rows: `Q6_0` when that is Q6_0's `5 · cols` (Q4_K's
    /// `64 · super-blocks + cols` and Q5_0's `3 · cols` never are), else the recipe's 4-bit
    /// rule: `Q4_K` for whole 256-column super-blocks, `Q5_0` otherwise.
    pub fn byte_scales_format(cols: usize, scale_cols: usize) -> &'static str {
        if cols > 0 && Some(scale_cols) == cols.checked_mul(5) {
            "Q6_0"
        } else if cols.is_multiple_of(256) {
            "Q4_K"
        } else {
            "Q5_0"
        }
    }

    /// `quant_method` and `format` as written.
    pub const KYLIN_METHOD: &'static str = "kylin";
    pub const Q8_0_FORMAT: &'static str = "q8_0-packed";
    pub const Q4_K_FORMAT: &'static str = "q4_k-packed";
    /// The `version` of each format this Kylin writes and reads. `q4_k-packed` version 1 kept
    /// Q5_0's and Q6_0's high bits as 64-bit masks, one word per weight vector and bit;
    /// version 2 keeps them as shifted bit fields, one 64-byte vector per four (Q6_0) or eight
    /// (Q5_0) weight vectors (`kylin_kernels::q56`'s layout).
    pub const Q8_0_VERSION: u64 = 1;
    pub const Q4_K_VERSION: u64 = 2;

    /// The `version` written for this quantization, the only one read.
    pub fn version(self) -> u64 {
        match self {
            StoredQuantization::KylinQ8_0 => Self::Q8_0_VERSION,
            StoredQuantization::KylinQ4K => Self::Q4_K_VERSION,
        }
    }

    /// The `format` written for this quantization.
    pub fn format(self) -> &'static str {
        match self {
            StoredQuantization::KylinQ8_0 => Self::Q8_0_FORMAT,
            StoredQuantization::KylinQ4K => Self::Q4_K_FORMAT,
        }
    }

    /// A short description for `inspect` (`kylin q8_0-packed`).
    pub fn describe(self) -> &'static str {
        match self {
            StoredQuantization::KylinQ8_0 => "kylin q8_0-packed (Q8_0, blocks of 32, f16 scales, rows in groups of 16)",
            StoredQuantization::KylinQ4K => {
                "kylin q4_k-packed (Q4_K super-blocks of 256, Q5_0 where the columns are not whole super-blocks, Q6_0 (or Q8_0 where the columns are not whole super-blocks) where the Q4_K_M recipe wants more bits; rows in groups of 16)"
            }
        }
    }
}

use serde_json::{Map, Value};

use crate::error::{KylinError, Result};

/// `config.json` as written, in either layout: every field optional, nothing decided yet.
///
/// Only the fields Kylin reads are kept; `raw` holds the whole object for `inspect`. Values are
/// taken with their JSON types checked, so a wrong type is a `CONFIG_INVALID` naming the field.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct HfConfig {
    pub architectures: Vec<String>,
    pub model_type: Option<String>,
    pub hidden_size: Option<u64>,
    pub num_hidden_layers: Option<u64>,
    pub num_attention_heads: Option<u64>,
    pub num_key_value_heads: Option<u64>,
    pub head_dim: Option<u64>,
    pub intermediate_size: Option<u64>,
    pub vocab_size: Option<u64>,
    pub max_position_embeddings: Option<u64>,
    pub rms_norm_eps: Option<f64>,
    pub hidden_act: Option<String>,
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: Option<bool>,
    pub mlp_bias: Option<bool>,
    /// Top-level `rope_theta` (older layout).
    pub rope_theta: Option<f64>,
    /// Top-level `partial_rotary_factor`.
    pub partial_rotary_factor: Option<f64>,
    /// Top-level `original_max_position_embeddings` (Phi-3 style; takes priority, as in transformers).
    pub original_max_position_embeddings: Option<u64>,
    /// `rope_parameters` (transformers 5) or `rope_scaling` (older layout), whichever is present.
    pub rope_parameters: Option<Map<String, Value>>,
    /// Which key the RoPE dictionary came from (`rope_parameters` or `rope_scaling`).
    pub rope_key: Option<&'static str>,
    pub use_sliding_window: Option<bool>,
    pub sliding_window: Option<u64>,
    /// Whether `sliding_window` is written in config.json at all (even as `null`).
    pub sliding_window_present: bool,
    pub max_window_layers: Option<u64>,
    pub layer_types: Option<Vec<String>>,
    /// `dtype` (transformers 5) or `torch_dtype`.
    pub dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Vec<u32>,
    /// `quantization_config`, as written.
    pub quantization_config: Option<Map<String, Value>>,
    /// The vision-language class (`Gemma3ForConditionalGeneration`) when these fields are its
    /// `text_config`: the language model is run, its weights under `model.language_model.*`.
    pub multimodal: Option<String>,
    /// The whole object, for the fields only one family reads (through [`raw_str`] and its
    /// siblings, which check their types).
    pub raw: Map<String, Value>,
}

/// Where a value is read from, for error messages: `config.json field 'x'`.
pub(crate) fn bad(field: &str, expected: &str, got: &Value) -> KylinError {
    let mut shown = got.to_string();
    if shown.len() > 80 {
        // Cut at a character boundary: the value may hold any Unicode (a fuzz finding: a cut
        // inside a multi-byte character panicked).
        let mut end = 80;
        while !shown.is_char_boundary(end) {
            end -= 1;
        }
        shown.truncate(end);
        shown.push_str("...");
    }
    KylinError::config_invalid(format!(
        "config.json field '{field}' must be {expected}, got {shown}; fix the value in config.json"
    ))
}

/// Reads an optional field; JSON `null` counts as absent, as transformers treats it.
pub(crate) fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn get_u64(obj: &Map<String, Value>, name: &str) -> Result<Option<u64>> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) => Ok(Some(n)),
            // An integral float such as `4096.0` is accepted, as Python's `int()` would.
            None => match v.as_f64() {
                Some(f) if f >= 0.0 && f.fract() == 0.0 && f < 9.0e15 => Ok(Some(f as u64)),
                _ => Err(bad(name, "a non-negative integer", v)),
            },
        },
    }
}

fn get_f64(obj: &Map<String, Value>, name: &str) -> Result<Option<f64>> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => v.as_f64().filter(|f| f.is_finite()).map(Some).ok_or_else(|| bad(name, "a number", v)),
    }
}

fn get_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| bad(name, "true or false", v)),
    }
}

fn get_str(obj: &Map<String, Value>, name: &str) -> Result<Option<String>> {
    match field(obj, name) {
        None => Ok(None),
        Some(v) => v.as_str().map(|s| Some(s.to_string())).ok_or_else(|| bad(name, "a string", v)),
    }
}

fn as_token_id(name: &str, v: &Value) -> Result<u32> {
    v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| bad(name, "a token id (integer)", v))
}

/// A token id field that may be an integer or a list of integers (`eos_token_id`).
pub(crate) fn get_id_list(obj: &Map<String, Value>, name: &str) -> Result<Vec<u32>> {
    match field(obj, name) {
        None => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(|v| as_token_id(name, v)).collect(),
        Some(v) => Ok(vec![as_token_id(name, v)?]),
    }
}

pub(crate) fn get_id(obj: &Map<String, Value>, name: &str) -> Result<Option<u32>> {
    field(obj, name).map(|v| as_token_id(name, v)).transpose()
}

impl HfConfig {
    /// Parses `config.json` text. Malformed JSON or a wrong type is `CONFIG_INVALID`.
    pub fn from_json_str(text: &str) -> Result<HfConfig> {
        let value: Value = serde_json::from_str(text)
            .map_err(|e| KylinError::config_invalid(format!("config.json is not valid JSON: {e}")))?;
        let Value::Object(obj) = value else {
            return Err(KylinError::config_invalid("config.json must be a JSON object"));
        };
        HfConfig::from_object(&obj)
    }

    /// Reads the fields Kylin uses from a parsed `config.json` object. A vision-language
    /// configuration (`text_config` nested, as `*ForConditionalGeneration` directories write it)
    /// gives its language model's fields, with the top level's architecture, token ids, dtype
    /// and quantization where the text part has none.
    pub fn from_object(obj: &Map<String, Value>) -> Result<HfConfig> {
        let top = HfConfig::from_flat_object(obj)?;
        let Some(text) = field(obj, "text_config") else { return Ok(top) };
        let Value::Object(text) = text else { return Err(bad("text_config", "an object", text)) };
        let mut lm = HfConfig::from_flat_object(text)?;
        lm.multimodal = top.architectures.first().cloned();
        lm.architectures = top.architectures;
        if lm.eos_token_id.is_empty() {
            lm.eos_token_id = top.eos_token_id;
        }
        lm.bos_token_id = lm.bos_token_id.or(top.bos_token_id);
        lm.dtype = lm.dtype.or(top.dtype);
        lm.tie_word_embeddings = lm.tie_word_embeddings.or(top.tie_word_embeddings);
        lm.quantization_config = lm.quantization_config.or(top.quantization_config);
        Ok(lm)
    }

    fn from_flat_object(obj: &Map<String, Value>) -> Result<HfConfig> {
        let architectures = match field(obj, "architectures") {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad("architectures", "a list of strings", v)))
                .collect::<Result<Vec<_>>>()?,
            Some(v) => return Err(bad("architectures", "a list of strings", v)),
        };
        let (rope_parameters, rope_key) = match (field(obj, "rope_parameters"), field(obj, "rope_scaling")) {
            (Some(Value::Object(m)), _) => (Some(m.clone()), Some("rope_parameters")),
            (Some(v), _) => return Err(bad("rope_parameters", "an object", v)),
            (None, Some(Value::Object(m))) => (Some(m.clone()), Some("rope_scaling")),
            (None, Some(v)) => return Err(bad("rope_scaling", "an object", v)),
            (None, None) => (None, None),
        };
        let layer_types = match field(obj, "layer_types") {
            None => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|v| v.as_str().map(str::to_string).ok_or_else(|| bad("layer_types", "a list of strings", v)))
                    .collect::<Result<Vec<_>>>()?,
            ),
            Some(v) => return Err(bad("layer_types", "a list of strings", v)),
        };
        Ok(HfConfig {
            architectures,
            model_type: get_str(obj, "model_type")?,
            hidden_size: get_u64(obj, "hidden_size")?,
            num_hidden_layers: get_u64(obj, "num_hidden_layers")?,
            num_attention_heads: get_u64(obj, "num_attention_heads")?,
            num_key_value_heads: get_u64(obj, "num_key_value_heads")?,
            head_dim: get_u64(obj, "head_dim")?,
            // LFM2's configurations may name it `block_ff_dim` (transformers reads that alias).
            intermediate_size: match get_u64(obj, "intermediate_size")? {
                Some(v) => Some(v),
                None => get_u64(obj, "block_ff_dim")?,
            },
            vocab_size: get_u64(obj, "vocab_size")?,
            max_position_embeddings: get_u64(obj, "max_position_embeddings")?,
            rms_norm_eps: get_f64(obj, "rms_norm_eps")?,
            hidden_act: get_str(obj, "hidden_act")?,
            tie_word_embeddings: get_bool(obj, "tie_word_embeddings")?,
            attention_bias: get_bool(obj, "attention_bias")?,
            mlp_bias: get_bool(obj, "mlp_bias")?,
            rope_theta: get_f64(obj, "rope_theta")?,
            partial_rotary_factor: get_f64(obj, "partial_rotary_factor")?,
            original_max_position_embeddings: get_u64(obj, "original_max_position_embeddings")?,
            rope_parameters,
            rope_key,
            use_sliding_window: get_bool(obj, "use_sliding_window")?,
            sliding_window: get_u64(obj, "sliding_window")?,
            sliding_window_present: obj.contains_key("sliding_window"),
            max_window_layers: get_u64(obj, "max_window_layers")?,
            layer_types,
            dtype: match get_str(obj, "dtype")? {
                Some(d) => Some(d),
                None => get_str(obj, "torch_dtype")?,
            },
            bos_token_id: get_id(obj, "bos_token_id")?,
            eos_token_id: get_id_list(obj, "eos_token_id")?,
            quantization_config: match field(obj, "quantization_config") {
                None => None,
                Some(Value::Object(m)) => Some(m.clone()),
                Some(v) => return Err(bad("quantization_config", "an object", v)),
            },
            multimodal: None,
            raw: obj.clone(),
        })
    }
}

/// The most decoder layers a configuration may declare.
pub const MAX_LAYERS: usize = 4096;

/// transformers' default `rms_norm_eps` for all four architectures.
pub const DEFAULT_RMS_NORM_EPS: f64 = 1e-6;
/// transformers' default `rope_theta` (`default_theta`).
pub const DEFAULT_ROPE_THETA: f64 = 10000.0;

impl Architecture {
    /// The architecture named by `architectures[0]`; `MAPPING_MISSING` for any other.
    pub fn from_hf_name(name: &str) -> Result<Architecture> {
        crate::family::find(name).map(Architecture).ok_or_else(|| {
            KylinError::mapping_missing(format!(
                "architecture '{name}' (config.json architectures[0]) has no tensor table; supported: {} (kylin inspect --architectures lists them)",
                Architecture::supported().join(", ")
            ))
        })
    }
}

/// A family's own string field of `config.json` (`None` when absent or null).
pub fn raw_str(hf: &HfConfig, name: &str) -> Result<Option<String>> {
    get_str(&hf.raw, name)
}

/// A family's own number field.
pub fn raw_f64(hf: &HfConfig, name: &str) -> Result<Option<f64>> {
    get_f64(&hf.raw, name)
}

/// A family's own non-negative integer field.
pub fn raw_u64(hf: &HfConfig, name: &str) -> Result<Option<u64>> {
    get_u64(&hf.raw, name)
}

/// A family's own boolean field.
pub fn raw_bool(hf: &HfConfig, name: &str) -> Result<Option<bool>> {
    get_bool(&hf.raw, name)
}

/// A family's own list of non-negative integers.
pub fn raw_u64_list(hf: &HfConfig, name: &str) -> Result<Option<Vec<u64>>> {
    match field(&hf.raw, name) {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| v.as_u64().ok_or_else(|| bad(name, "a list of non-negative integers", v)))
            .collect::<Result<Vec<_>>>()
            .map(Some),
        Some(v) => Err(bad(name, "a list of non-negative integers", v)),
    }
}

/// Takes a required positive size, or `CONFIG_INVALID` naming it.
fn required(value: Option<u64>, name: &str) -> Result<usize> {
    let v = value.ok_or_else(|| {
        KylinError::config_invalid(format!("config.json has no '{name}'; it is required to build the model"))
    })?;
    positive(v, name)
}

fn positive(v: u64, name: &str) -> Result<usize> {
    if v == 0 {
        return Err(KylinError::config_invalid(format!("config.json field '{name}' is 0; it must be positive")));
    }
    // Sizes beyond 2^32 cannot describe a model that fits in memory; refusing them here keeps
    // every product of two sizes far from overflow.
    if v > u32::MAX as u64 {
        return Err(KylinError::config_invalid(format!(
            "config.json field '{name}' is {v}, which is implausibly large"
        )));
    }
    Ok(v as usize)
}

impl HfConfig {
    /// Decides every value: defaults filled in (and recorded in `defaulted`), the RoPE variant
    /// resolved with transformers' rules, and every combination Kylin cannot run refused.
    pub fn resolve(&self) -> Result<ModelConfig> {
        let mut defaulted: Vec<String> = Vec::new();
        let arch_name = self.architectures.first().ok_or_else(|| {
            KylinError::config_invalid(format!(
                "config.json has no 'architectures' list; expected one of: {}",
                Architecture::supported().join(", ")
            ))
        })?;
        let architecture = Architecture::from_hf_name(arch_name)?;
        let family = architecture.family();
        let d = family.defaults;

        let hidden_size = required(self.hidden_size, "hidden_size")?;
        let num_layers = required(self.num_hidden_layers, "num_hidden_layers")?;
        // The decoder's per-layer plan is sized by this number: a bound keeps a hostile file
        // from asking for gigabytes (the deepest published decoders have about 130 layers).
        if num_layers > MAX_LAYERS {
            return Err(KylinError::config_invalid(format!(
                "config.json field 'num_hidden_layers' is {num_layers}, which is implausibly large (at most {MAX_LAYERS})"
            )));
        }
        let num_heads = required(self.num_attention_heads, "num_attention_heads")?;
        let intermediate_size = match (self.intermediate_size, d.intermediate_size) {
            (None, Some(default)) => {
                defaulted.push("intermediate_size".into());
                default
            }
            (given, _) => required(given, "intermediate_size")?,
        };
        let vocab_size = required(self.vocab_size, "vocab_size")?;

        let num_kv_heads = match self.num_key_value_heads {
            Some(v) => positive(v, "num_key_value_heads")?,
            None => {
                defaulted.push("num_key_value_heads".into());
                num_heads
            }
        };
        if num_heads % num_kv_heads != 0 {
            return Err(KylinError::config_invalid(format!(
                "config.json: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}"
            )));
        }
        let head_dim = match self.head_dim {
            Some(v) => positive(v, "head_dim")?,
            None => {
                defaulted.push("head_dim".into());
                match d.head_dim {
                    Some(h) => h,
                    None => {
                        if hidden_size % num_heads != 0 {
                            return Err(KylinError::config_invalid(format!(
                                "config.json: hidden_size={hidden_size} is not divisible by \
                                 num_attention_heads={num_heads} and no head_dim is given"
                            )));
                        }
                        hidden_size / num_heads
                    }
                }
            }
        };
        let max_position_embeddings = match self.max_position_embeddings {
            Some(v) => positive(v, "max_position_embeddings")?,
            None => {
                defaulted.push("max_position_embeddings".into());
                d.max_position_embeddings
            }
        };
        let rms_norm_eps = match self.rms_norm_eps {
            Some(e) if e > 0.0 && e < 1.0 => e,
            Some(e) => {
                return Err(KylinError::config_invalid(format!(
                    "config.json field 'rms_norm_eps' is {e}; it must be in (0, 1)"
                )));
            }
            None => {
                defaulted.push("rms_norm_eps".into());
                d.rms_norm_eps
            }
        };
        let tie_word_embeddings = self.tie_word_embeddings.unwrap_or_else(|| {
            defaulted.push("tie_word_embeddings".into());
            d.tie_word_embeddings
        });
        let rope = self.resolve_rope(max_position_embeddings, d.rope_theta, &mut defaulted)?;

        let mut eos_token_ids = self.eos_token_id.clone();
        eos_token_ids.sort_unstable();
        eos_token_ids.dedup();
        let (stored, published) = self.resolve_quantization()?;
        let mut config = ModelConfig {
            architecture,
            model_type: self.model_type.clone().unwrap_or_else(|| family.model_type.to_string()),
            hidden_size,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            intermediate_size,
            vocab_size,
            max_position_embeddings,
            rms_norm_eps,
            rope,
            tie_word_embeddings,
            qkv_bias: false,
            o_bias: false,
            mlp_bias: false,
            hidden_act: "silu".into(),
            decoder: DecoderSpec::plain(num_layers, head_dim, num_kv_heads, intermediate_size),
            multimodal: self.multimodal.clone(),
            declared_dtype: self.dtype.clone(),
            bos_token_id: self.bos_token_id,
            eos_token_ids,
            defaulted,
            quantization: stored,
            published,
        };
        // The family's own fields and decisions.
        (family.resolve)(self, &mut config)?;
        if (config.quantization.is_some() || config.published.is_some()) && family.has_fused_projections() {
            return Err(KylinError::operator_unsupported(format!(
                "{} stores fused projections (qkv_proj, gate_up_proj); Kylin does not read them quantized yet: run the BF16 checkpoint (optionally with --quantize)",
                architecture.hf_name()
            )));
        }
        Ok(config)
    }

    /// `attention_bias` as Llama reads it (q, k, v and o together), defaulting to false.
    pub(crate) fn attention_bias_or_default(&self, config: &mut ModelConfig) {
        let b = self.attention_bias.unwrap_or_else(|| {
            config.defaulted.push("attention_bias".into());
            false
        });
        config.qkv_bias = b;
        config.o_bias = b;
    }

    /// Llama's biases: `attention_bias` (q, k, v and o) and `mlp_bias`, both defaulting to false.
    pub(crate) fn llama_biases_or_default(&self, config: &mut ModelConfig) {
        self.attention_bias_or_default(config);
        config.mlp_bias = self.mlp_bias.unwrap_or_else(|| {
            config.defaulted.push("mlp_bias".into());
            false
        });
    }

    /// `hidden_act` for the SwiGLU families: `silu` (the default) only.
    pub(crate) fn silu_only(&self, config: &mut ModelConfig) -> Result<()> {
        crate::family::activation(self, "hidden_act", crate::family::Activation::Silu, config)?;
        if config.decoder.activation != crate::family::Activation::Silu {
            return Err(KylinError::config_invalid(format!(
                "config.json field 'hidden_act' is '{}'; Kylin's {} block supports only 'silu'",
                config.hidden_act,
                config.architecture.hf_name()
            )));
        }
        Ok(())
    }

    /// The stored quantization from `quantization_config`: Kylin's own Q8_0 planes; any other
    /// method or format is `OPERATOR_UNSUPPORTED` naming the field and value.
    fn resolve_quantization(
        &self,
    ) -> Result<(Option<StoredQuantization>, Option<crate::published::PublishedQuantization>)> {
        let Some(q) = &self.quantization_config else { return Ok((None, None)) };
        let text = |k: &str| -> Result<Option<&str>> {
            match field(q, k) {
                None => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.as_str())),
                Some(v) => Err(bad(&format!("quantization_config.{k}"), "a string", v)),
            }
        };
        let method = text("quant_method")?.ok_or_else(|| {
            KylinError::config_invalid("config.json field 'quantization_config' has no 'quant_method'")
        })?;
        if let Some(published) = crate::published::PublishedQuantization::parse(method, q)? {
            return Ok((None, Some(published)));
        }
        if method != StoredQuantization::KYLIN_METHOD {
            return Err(KylinError::operator_unsupported(format!(
                "config.json quantization_config.quant_method is '{method}'; Kylin reads 'compressed-tensors', 'fp8', 'gptq', 'awq' and checkpoints written by 'kylin quantize' (quant_method 'kylin'), or quantizes at load with --quantize q8_0|q4_k from BF16/F16/F32 weights"
            )));
        }
        let stored = match text("format")? {
            Some(StoredQuantization::Q8_0_FORMAT) => StoredQuantization::KylinQ8_0,
            Some(StoredQuantization::Q4_K_FORMAT) => StoredQuantization::KylinQ4K,
            other => {
                return Err(KylinError::operator_unsupported(format!(
                    "config.json quantization_config.format is {}; Kylin reads '{}' or '{}'",
                    other.map_or("missing".to_string(), |f| format!("'{f}'")),
                    StoredQuantization::Q8_0_FORMAT,
                    StoredQuantization::Q4_K_FORMAT
                )));
            }
        };
        let reads = stored.version();
        match q.get("version").and_then(Value::as_u64) {
            Some(v) if v == reads => Ok((Some(stored), None)),
            Some(1) if stored == StoredQuantization::KylinQ4K => Err(KylinError::model_version_incompatible(format!(
                "config.json quantization_config.version is 1: this '{}' directory was written by an earlier Kylin, whose Q5_0 and Q6_0 planes lay out their high bits differently; this Kylin reads version {reads}. Write it again with 'kylin quantize SOURCE --to q4_k OUT_DIR'",
                StoredQuantization::Q4_K_FORMAT
            ))),
            _ => Err(KylinError::model_version_incompatible(format!(
                "config.json quantization_config.version is {}; this Kylin reads version {reads} of '{}'",
                q.get("version").map_or("missing".to_string(), |v| v.to_string()),
                stored.format()
            ))),
        }
    }

    /// Resolves the RoPE dictionary (either layout) with transformers' rules
    /// (`standardize_rope_params` and the `_compute_*_parameters` functions).
    fn resolve_rope(
        &self,
        max_positions: usize,
        theta_default: f64,
        defaulted: &mut Vec<String>,
    ) -> Result<RopeConfig> {
        let empty = Map::new();
        let params = self.rope_parameters.as_ref().unwrap_or(&empty);
        let key = self.rope_key.unwrap_or("rope_parameters");
        self.resolve_rope_params(params, key, self.rope_theta, theta_default, max_positions, defaulted)
    }

    /// Resolves one RoPE dictionary `params` (read from `key`, for messages): the global one,
    /// or one of Gemma 3's per-layer-type dictionaries. `top_theta` is a top-level base that
    /// applies when the dictionary has none.
    pub(crate) fn resolve_rope_params(
        &self,
        params: &Map<String, Value>,
        key: &str,
        top_theta: Option<f64>,
        theta_default: f64,
        max_positions: usize,
        defaulted: &mut Vec<String>,
    ) -> Result<RopeConfig> {
        let name = |k: &str| format!("{key}.{k}");
        let p_f64 = |k: &str| -> Result<Option<f64>> {
            match field(params, k) {
                None => Ok(None),
                Some(v) => v.as_f64().filter(|f| f.is_finite()).map(Some).ok_or_else(|| bad(&name(k), "a number", v)),
            }
        };
        let p_u64 = |k: &str| -> Result<Option<u64>> {
            match get_u64(params, k) {
                Ok(v) => Ok(v),
                Err(_) => Err(bad(&name(k), "a non-negative integer", field(params, k).unwrap_or(&Value::Null))),
            }
        };

        let rope_type = match (field(params, "rope_type"), field(params, "type")) {
            (Some(v), _) => v.as_str().ok_or_else(|| bad(&name("rope_type"), "a string", v))?.to_string(),
            (None, Some(v)) => v.as_str().ok_or_else(|| bad(&name("type"), "a string", v))?.to_string(),
            (None, None) => "default".to_string(),
        };
        let theta = match (p_f64("rope_theta")?, top_theta) {
            (Some(t), _) | (None, Some(t)) => t,
            (None, None) => {
                defaulted.push("rope_theta".into());
                theta_default
            }
        };
        if theta <= 1.0 {
            return Err(KylinError::config_invalid(format!("config.json rope_theta is {theta}; it must be > 1")));
        }
        // Defaults are recorded under one spelling so that both layouts give identical configs.
        let mut note = |k: &str| defaulted.push(format!("rope_parameters.{k}"));
        let partial_rotary_factor = p_f64("partial_rotary_factor")?.or(self.partial_rotary_factor).unwrap_or(1.0);
        if !(partial_rotary_factor > 0.0 && partial_rotary_factor <= 1.0) {
            return Err(KylinError::config_invalid(format!(
                "config.json partial_rotary_factor is {partial_rotary_factor}; it must be in (0, 1]"
            )));
        }
        let factor_required = |f: Option<f64>| -> Result<f64> {
            let f = f.ok_or_else(|| {
                KylinError::config_invalid(format!("config.json {key} of type '{rope_type}' needs 'factor'"))
            })?;
            if f <= 0.0 {
                return Err(KylinError::config_invalid(format!(
                    "config.json {} is {f}; it must be > 0",
                    name("factor")
                )));
            }
            Ok(f)
        };
        let original_max = |note: &mut dyn FnMut(&str)| -> Result<usize> {
            // transformers gives a top-level `original_max_position_embeddings` priority, then the
            // dictionary's, then falls back to `max_position_embeddings`.
            match (self.original_max_position_embeddings, p_u64("original_max_position_embeddings")?) {
                (Some(v), _) => positive(v, "original_max_position_embeddings"),
                (None, Some(v)) => positive(v, &name("original_max_position_embeddings")),
                (None, None) => {
                    note("original_max_position_embeddings");
                    Ok(max_positions)
                }
            }
        };
        let scaling = match rope_type.as_str() {
            "default" => RopeScaling::Default,
            "linear" => RopeScaling::Linear { factor: factor_required(p_f64("factor")?)? },
            "dynamic" => {
                let factor = factor_required(p_f64("factor")?)?;
                let original_max_position_embeddings = match p_u64("original_max_position_embeddings")? {
                    Some(v) => positive(v, &name("original_max_position_embeddings"))?,
                    None => max_positions,
                };
                RopeScaling::Dynamic { factor, original_max_position_embeddings }
            }
            "yarn" => {
                let original_max_position_embeddings = original_max(&mut note)?;
                let factor = match p_f64("factor")? {
                    Some(f) => factor_required(Some(f))?,
                    None => {
                        note("factor");
                        max_positions as f64 / original_max_position_embeddings as f64
                    }
                };
                // `get("beta_fast") or 32`: a zero counts as absent, as in Python.
                let beta_fast = match p_f64("beta_fast")? {
                    Some(b) if b != 0.0 => b,
                    _ => {
                        note("beta_fast");
                        32.0
                    }
                };
                let beta_slow = match p_f64("beta_slow")? {
                    Some(b) if b != 0.0 => b,
                    _ => {
                        note("beta_slow");
                        1.0
                    }
                };
                let mscale = p_f64("mscale")?;
                let mscale_all_dim = p_f64("mscale_all_dim")?;
                let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention_factor = match p_f64("attention_factor")? {
                    Some(a) => a,
                    None => {
                        note("attention_factor");
                        match (mscale, mscale_all_dim) {
                            (Some(m), Some(a)) if m != 0.0 && a != 0.0 => get_mscale(factor, m) / get_mscale(factor, a),
                            _ => get_mscale(factor, 1.0),
                        }
                    }
                };
                let truncate = match field(params, "truncate") {
                    None => {
                        note("truncate");
                        true
                    }
                    Some(v) => v.as_bool().ok_or_else(|| bad(&name("truncate"), "true or false", v))?,
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings,
                    beta_fast,
                    beta_slow,
                    mscale,
                    mscale_all_dim,
                    attention_factor,
                    truncate,
                }
            }
            // Gemma 4's global layers: RoPE over the whole head, with only the first
            // `partial_rotary_factor` of the frequencies non-zero.
            "proportional" => RopeScaling::Proportional {
                factor: match p_f64("factor")? {
                    Some(f) => factor_required(Some(f))?,
                    None => 1.0,
                },
            },
            "llama3" => {
                let factor = factor_required(p_f64("factor")?)?;
                let need = |k: &str| -> Result<f64> {
                    p_f64(k)?.ok_or_else(|| {
                        KylinError::config_invalid(format!("config.json {key} of type 'llama3' needs '{k}'"))
                    })
                };
                let low_freq_factor = need("low_freq_factor")?;
                let high_freq_factor = need("high_freq_factor")?;
                if high_freq_factor <= low_freq_factor {
                    return Err(KylinError::config_invalid(format!(
                        "config.json {key}: high_freq_factor={high_freq_factor} must be greater than \
                         low_freq_factor={low_freq_factor}"
                    )));
                }
                let original_max_position_embeddings = original_max(&mut note)?;
                RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings }
            }
            "longrope" | "su" => {
                let list = |k: &str| -> Result<Vec<f64>> {
                    match field(params, k) {
                        Some(Value::Array(items)) => items
                            .iter()
                            .map(|v| {
                                v.as_f64()
                                    .filter(|f| f.is_finite() && *f > 0.0)
                                    .ok_or_else(|| bad(&name(k), "a list of positive numbers", v))
                            })
                            .collect(),
                        Some(v) => Err(bad(&name(k), "a list of positive numbers", v)),
                        None => Err(KylinError::config_invalid(format!(
                            "config.json {key} of type '{rope_type}' needs '{k}'"
                        ))),
                    }
                };
                let short_factor = list("short_factor")?;
                let long_factor = list("long_factor")?;
                if short_factor.len() != long_factor.len() {
                    return Err(KylinError::config_invalid(format!(
                        "config.json {key}: short_factor has {} entries and long_factor {}; they must be equal (half the rotated dimensions)",
                        short_factor.len(),
                        long_factor.len()
                    )));
                }
                let original_max_position_embeddings = original_max(&mut note)?;
                // transformers: `factor` when given, else the ratio of the two lengths.
                let factor = match p_f64("factor")? {
                    Some(f) => factor_required(Some(f))?,
                    None => max_positions as f64 / original_max_position_embeddings as f64,
                };
                let attention_factor = match p_f64("attention_factor")? {
                    Some(a) => a,
                    None if factor <= 1.0 => 1.0,
                    None => (1.0 + factor.ln() / (original_max_position_embeddings as f64).ln()).sqrt(),
                };
                RopeScaling::LongRope { short_factor, long_factor, original_max_position_embeddings, attention_factor }
            }
            other => {
                return Err(KylinError::operator_unsupported(format!(
                    "config.json {key} has rope_type '{other}'; Kylin implements default, linear, dynamic, yarn, llama3, longrope and proportional"
                )));
            }
        };
        Ok(RopeConfig { theta, partial_rotary_factor, scaling, multimodal: None })
    }
}
