//! Encoder checkpoints (BERT, RoBERTa, XLM-RoBERTa) and the sentence-transformers files that
//! say how their outputs become embeddings or scores.
//!
//! An encoder directory is `config.json` (`BertModel`, `XLMRobertaModel`, `RobertaModel`, or
//! their `*ForSequenceClassification` cross-encoders), safetensors weights, `tokenizer.json`,
//! and for embedding models sentence-transformers' `modules.json`, `1_Pooling/config.json`,
//! `sentence_bert_config.json` and `config_sentence_transformers.json`. [`load_encoder`] reads
//! them all, checks every value it uses (naming the file and field), binds every tensor with
//! its exact shape (naming the tensor, expected vs got), and returns views into the maps: the
//! weights are never copied.
//!
//! One table serves the whole family: the three architectures differ only in where positions
//! start (RoBERTa's `padding_idx + 1`), in their token-type table, and in their classifier
//! (BERT's pooler + `classifier`, RoBERTa's `classifier.dense` + `classifier.out_proj`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{KylinError, Result, regular_file};
use crate::safetensors_file::{self, TensorIndex};
use crate::tensor::{DType, WeightTensor};
use crate::tokenizer::{self, TokenizerBundle};

/// The encoder architectures Kylin runs, by `architectures[0]`.
pub const ENCODER_ARCHITECTURES: &[&str] = &[
    "BertModel",
    "BertForSequenceClassification",
    "RobertaModel",
    "RobertaForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
];

/// True when `dir/config.json` names an encoder architecture (read without resolving anything
/// else, so a decoder directory costs one small parse).
pub fn is_encoder_dir(dir: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(dir.join("config.json")) else { return false };
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(&text) else { return false };
    architecture_of(&map).is_some_and(|a| ENCODER_ARCHITECTURES.contains(&a))
}

fn architecture_of(map: &Map<String, Value>) -> Option<&str> {
    map.get("architectures")?.as_array()?.first()?.as_str()
}

/// Which member of the family: where positions start and how the classifier is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EncoderKind {
    /// BERT: positions from 0; classifier = pooler (`dense` + tanh on `[CLS]`) + `classifier`.
    Bert,
    /// RoBERTa and XLM-RoBERTa: positions from `pad_token_id + 1`; classifier =
    /// `classifier.dense` + tanh + `classifier.out_proj` on `<s>`.
    Roberta,
}

/// An encoder's configuration, every value decided.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EncoderConfig {
    /// `architectures[0]`.
    pub architecture: String,
    pub kind: EncoderKind,
    pub vocab_size: usize,
    pub hidden: usize,
    pub layers: usize,
    pub heads: usize,
    pub intermediate: usize,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f32,
    /// Position id of the first token (0 for BERT, `pad_token_id + 1` for RoBERTa).
    pub position_offset: usize,
    /// Labels of a sequence-classification head (`None`: the bare encoder).
    pub num_labels: Option<usize>,
}

impl EncoderConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// The longest sequence the position table holds.
    pub fn max_tokens(&self) -> usize {
        self.max_position_embeddings.saturating_sub(self.position_offset)
    }
}

/// How token states become one vector (sentence-transformers' `Pooling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Pooling {
    /// The first token's state (`[CLS]`).
    Cls,
    /// The mean of every token's state.
    Mean,
    /// The element-wise maximum.
    Max,
    /// The mean times the square root of the length.
    MeanSqrtLen,
    /// The last token's state (decoder embedders such as Qwen3-Embedding).
    LastToken,
}

impl Pooling {
    pub fn name(self) -> &'static str {
        match self {
            Pooling::Cls => "cls",
            Pooling::Mean => "mean",
            Pooling::Max => "max",
            Pooling::MeanSqrtLen => "mean_sqrt_len",
            Pooling::LastToken => "last_token",
        }
    }
}

/// What sentence-transformers' files say about turning a model's states into embeddings.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SentenceConfig {
    pub pooling: Pooling,
    /// `modules.json` ends with a `Normalize` module: embeddings have unit length.
    pub normalize: bool,
    /// `sentence_bert_config.json`'s `max_seq_length`, if given.
    pub max_seq_length: Option<usize>,
    /// `config_sentence_transformers.json`'s named prompts (e.g. `query`), prefixed to the text.
    pub prompts: BTreeMap<String, String>,
    pub default_prompt_name: Option<String>,
    /// The embedding width the pooling module declares (`word_embedding_dimension`).
    pub dimension: Option<usize>,
    /// Where the configuration came from, for reports.
    pub source: String,
}

/// An encoder checkpoint ready for the engine: weights as views into the maps.
#[derive(Debug)]
pub struct LoadedEncoder {
    pub dir: PathBuf,
    pub config: EncoderConfig,
    /// Tensors by role name (see [`EncoderConfig`]'s table: `embeddings.word`, `layer.0.query`, ...).
    pub tensors: BTreeMap<String, WeightTensor>,
    pub sentence: Option<SentenceConfig>,
    pub tokenizer: Option<TokenizerBundle>,
    /// Bytes of tensor data stored in the checkpoint.
    pub total_bytes: u64,
    pub warnings: Vec<String>,
}

impl LoadedEncoder {
    /// The bound tensor of `role`; every role of the table is bound by [`load_encoder`].
    pub fn tensor(&self, role: &str) -> Result<&WeightTensor> {
        self.tensors
            .get(role)
            .ok_or_else(|| KylinError::tensor_missing(format!("internal: encoder role '{role}' is not bound")))
    }
}

fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let text = std::fs::read_to_string(path).map_err(|e| KylinError::io(path, "cannot read", &e))?;
    tokenizer::parse_json_object(&text, path)
}

/// A positive integer field of `config.json`.
fn usize_field(map: &Map<String, Value>, key: &str, default: Option<usize>, path: &Path) -> Result<usize> {
    match map.get(key) {
        None | Some(Value::Null) => default.ok_or_else(|| {
            KylinError::config_missing(format!("config.json has no `{key}`, which an encoder needs")).at(path)
        }),
        Some(v) => {
            v.as_u64().and_then(|n| usize::try_from(n).ok()).filter(|&n| n > 0 && n <= 1 << 24).ok_or_else(|| {
                KylinError::config_invalid(format!("config.json `{key}` must be an integer in 1..=2^24; got {v}"))
                    .at(path)
            })
        }
    }
}

/// Reads `config.json` of an encoder directory.
pub fn read_encoder_config(dir: &Path) -> Result<EncoderConfig> {
    let path = dir.join("config.json");
    let map = read_json(&path)?;
    let architecture = architecture_of(&map)
        .ok_or_else(|| KylinError::config_missing("config.json has no `architectures`").at(&path))?
        .to_string();
    if !ENCODER_ARCHITECTURES.contains(&architecture.as_str()) {
        return Err(KylinError::mapping_missing(format!(
            "`{architecture}` is not an encoder Kylin runs; encoders: {}",
            ENCODER_ARCHITECTURES.join(", ")
        ))
        .at(&path));
    }
    let kind = if architecture.starts_with("Bert") { EncoderKind::Bert } else { EncoderKind::Roberta };
    let hidden = usize_field(&map, "hidden_size", None, &path)?;
    let heads = usize_field(&map, "num_attention_heads", None, &path)?;
    if hidden % heads != 0 {
        return Err(KylinError::config_invalid(format!(
            "config.json hidden_size {hidden} is not a multiple of num_attention_heads {heads}"
        ))
        .at(&path));
    }
    match map.get("hidden_act").and_then(Value::as_str) {
        None | Some("gelu") => {}
        Some(other) => {
            return Err(KylinError::operator_unsupported(format!(
                "config.json hidden_act `{other}`: the encoder runs `gelu` (erf) only"
            ))
            .at(&path));
        }
    }
    match map.get("position_embedding_type").and_then(Value::as_str) {
        None | Some("absolute") => {}
        Some(other) => {
            return Err(KylinError::operator_unsupported(format!(
                "config.json position_embedding_type `{other}`: only `absolute` positions are implemented"
            ))
            .at(&path));
        }
    }
    let eps = match map.get("layer_norm_eps") {
        None | Some(Value::Null) => 1e-12,
        Some(v) => v.as_f64().filter(|e| *e > 0.0 && *e < 1.0).ok_or_else(|| {
            KylinError::config_invalid(format!("config.json layer_norm_eps must be a number in (0, 1); got {v}"))
                .at(&path)
        })?,
    };
    let pad = match map.get("pad_token_id") {
        None | Some(Value::Null) => 1,
        Some(v) => v.as_u64().and_then(|n| usize::try_from(n).ok()).filter(|&n| n < 1 << 24).ok_or_else(|| {
            KylinError::config_invalid(format!("config.json pad_token_id must be a small integer; got {v}")).at(&path)
        })?,
    };
    let num_labels = if architecture.ends_with("ForSequenceClassification") {
        let from_map = map.get("id2label").and_then(Value::as_object).map(Map::len).filter(|&n| n > 0);
        Some(match map.get("num_labels") {
            Some(_) => usize_field(&map, "num_labels", None, &path)?,
            None => from_map.unwrap_or(2),
        })
    } else {
        None
    };
    let config = EncoderConfig {
        architecture,
        kind,
        vocab_size: usize_field(&map, "vocab_size", None, &path)?,
        hidden,
        layers: usize_field(&map, "num_hidden_layers", None, &path)?,
        heads,
        intermediate: usize_field(&map, "intermediate_size", None, &path)?,
        max_position_embeddings: usize_field(&map, "max_position_embeddings", Some(512), &path)?,
        type_vocab_size: usize_field(&map, "type_vocab_size", Some(2), &path)?,
        layer_norm_eps: eps as f32,
        position_offset: if kind == EncoderKind::Roberta { pad + 1 } else { 0 },
        num_labels,
    };
    if config.max_tokens() == 0 {
        return Err(KylinError::config_invalid(format!(
            "config.json max_position_embeddings {} leaves no position after the offset {}",
            config.max_position_embeddings, config.position_offset
        ))
        .at(&path));
    }
    Ok(config)
}

/// The tensor table: role name, checkpoint name (after the prefix), shape.
fn table(c: &EncoderConfig) -> Vec<(String, String, Vec<usize>)> {
    let (h, i) = (c.hidden, c.intermediate);
    let mut t = vec![
        ("embeddings.word".into(), "embeddings.word_embeddings.weight".into(), vec![c.vocab_size, h]),
        (
            "embeddings.position".into(),
            "embeddings.position_embeddings.weight".into(),
            vec![c.max_position_embeddings, h],
        ),
        ("embeddings.token_type".into(), "embeddings.token_type_embeddings.weight".into(), vec![c.type_vocab_size, h]),
        ("embeddings.norm.weight".into(), "embeddings.LayerNorm.weight".into(), vec![h]),
        ("embeddings.norm.bias".into(), "embeddings.LayerNorm.bias".into(), vec![h]),
    ];
    for l in 0..c.layers {
        let p = format!("encoder.layer.{l}.");
        let mut add = |role: &str, name: &str, shape: Vec<usize>| {
            t.push((format!("layer.{l}.{role}"), format!("{p}{name}"), shape));
        };
        for (role, name) in [("query", "query"), ("key", "key"), ("value", "value")] {
            add(&format!("{role}.weight"), &format!("attention.self.{name}.weight"), vec![h, h]);
            add(&format!("{role}.bias"), &format!("attention.self.{name}.bias"), vec![h]);
        }
        add("attention_out.weight", "attention.output.dense.weight", vec![h, h]);
        add("attention_out.bias", "attention.output.dense.bias", vec![h]);
        add("attention_norm.weight", "attention.output.LayerNorm.weight", vec![h]);
        add("attention_norm.bias", "attention.output.LayerNorm.bias", vec![h]);
        add("intermediate.weight", "intermediate.dense.weight", vec![i, h]);
        add("intermediate.bias", "intermediate.dense.bias", vec![i]);
        add("output.weight", "output.dense.weight", vec![h, i]);
        add("output.bias", "output.dense.bias", vec![h]);
        add("output_norm.weight", "output.LayerNorm.weight", vec![h]);
        add("output_norm.bias", "output.LayerNorm.bias", vec![h]);
    }
    t
}

/// The classifier's tensors: role, full checkpoint name (no prefix applies), shape.
fn classifier_table(c: &EncoderConfig, prefix: &str, labels: usize) -> Vec<(String, String, Vec<usize>)> {
    let h = c.hidden;
    match c.kind {
        EncoderKind::Bert => vec![
            ("classifier.dense.weight".into(), format!("{prefix}pooler.dense.weight"), vec![h, h]),
            ("classifier.dense.bias".into(), format!("{prefix}pooler.dense.bias"), vec![h]),
            ("classifier.out.weight".into(), "classifier.weight".into(), vec![labels, h]),
            ("classifier.out.bias".into(), "classifier.bias".into(), vec![labels]),
        ],
        EncoderKind::Roberta => vec![
            ("classifier.dense.weight".into(), "classifier.dense.weight".into(), vec![h, h]),
            ("classifier.dense.bias".into(), "classifier.dense.bias".into(), vec![h]),
            ("classifier.out.weight".into(), "classifier.out_proj.weight".into(), vec![labels, h]),
            ("classifier.out.bias".into(), "classifier.out_proj.bias".into(), vec![labels]),
        ],
    }
}

/// Binds tensor `name` of `index` with exactly `shape`, stored as F32, F16 or BF16.
pub(crate) fn bind_one(index: &TensorIndex, name: &str, shape: &[usize], dir: &Path) -> Result<WeightTensor> {
    let raw = index
        .raw(name)
        .ok_or_else(|| KylinError::tensor_missing(format!("tensor '{name}' is missing from the checkpoint")).at(dir))?;
    if raw.shape != shape {
        return Err(KylinError::tensor_shape_mismatch(format!(
            "tensor '{name}' has wrong shape; expected {shape:?}, got {:?}",
            raw.shape
        ))
        .at(index.path_of(name).unwrap_or(dir)));
    }
    match raw.dtype {
        Some(DType::F32 | DType::F16 | DType::BF16) => {}
        _ => {
            return Err(KylinError::tensor_dtype_unsupported(format!(
                "tensor '{name}' is {}; Kylin reads it as F32, F16 or BF16",
                raw.dtype_name
            ))
            .at(index.path_of(name).unwrap_or(dir)));
        }
    }
    index.view(name).ok_or_else(|| KylinError::file_corrupted(format!("tensor '{name}' cannot be viewed")).at(dir))
}

/// Reads sentence-transformers' files of `dir`, if `modules.json` is there.
pub fn read_sentence_config(dir: &Path) -> Result<Option<SentenceConfig>> {
    let modules_path = dir.join("modules.json");
    if !regular_file(&modules_path)? {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&modules_path).map_err(|e| KylinError::io(&modules_path, "cannot read", &e))?;
    let modules: Vec<Value> = serde_json::from_str(&text).map_err(|e| {
        KylinError::config_invalid(format!("modules.json is not a JSON list of modules: {e}")).at(&modules_path)
    })?;
    let mut pooling = None;
    let mut dimension = None;
    let mut normalize = false;
    for (i, m) in modules.iter().enumerate() {
        let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
        let sub = m.get("path").and_then(Value::as_str).unwrap_or("");
        let short = kind.rsplit('.').next().unwrap_or(kind);
        match short {
            "Transformer" => {}
            "Pooling" => {
                if sub.contains("..") || sub.starts_with('/') {
                    return Err(KylinError::config_invalid(format!(
                        "modules.json[{i}].path `{sub}` leaves the directory"
                    ))
                    .at(&modules_path));
                }
                let path = dir.join(sub).join("config.json");
                let cfg = read_json(&path)?;
                let on = |key: &str| cfg.get(key).and_then(Value::as_bool).unwrap_or(false);
                let mut modes = Vec::new();
                // sentence-transformers 6 writes `pooling_mode` (a name or a list of names);
                // older versions one boolean per mode.
                let named: Vec<&str> = match cfg.get("pooling_mode") {
                    Some(Value::String(m)) => vec![m.as_str()],
                    Some(Value::Array(list)) => list.iter().filter_map(Value::as_str).collect(),
                    _ => Vec::new(),
                };
                for name in named {
                    modes.push(match name {
                        "cls" | "cls_token" => Pooling::Cls,
                        "mean" | "mean_tokens" => Pooling::Mean,
                        "max" | "max_tokens" => Pooling::Max,
                        "mean_sqrt_len_tokens" | "mean_sqrt_len" => Pooling::MeanSqrtLen,
                        "lasttoken" | "last_token" => Pooling::LastToken,
                        other => {
                            return Err(KylinError::operator_unsupported(format!(
                                "pooling_mode `{other}` is not implemented (cls, mean, max, mean_sqrt_len_tokens and lasttoken are)"
                            ))
                            .at(&path));
                        }
                    });
                }
                if on("pooling_mode_cls_token") {
                    modes.push(Pooling::Cls);
                }
                if on("pooling_mode_mean_tokens") {
                    modes.push(Pooling::Mean);
                }
                if on("pooling_mode_max_tokens") {
                    modes.push(Pooling::Max);
                }
                if on("pooling_mode_mean_sqrt_len_tokens") {
                    modes.push(Pooling::MeanSqrtLen);
                }
                if on("pooling_mode_lasttoken") {
                    modes.push(Pooling::LastToken);
                }
                if on("pooling_mode_weightedmean_tokens")
                    || cfg.get("include_prompt").and_then(Value::as_bool) == Some(false)
                {
                    return Err(KylinError::operator_unsupported(
                        "1_Pooling/config.json asks for weighted-mean pooling or include_prompt false, which are not implemented",
                    )
                    .at(&path));
                }
                pooling = Some(match modes.as_slice() {
                    [one] => *one,
                    [] => {
                        return Err(KylinError::config_invalid("the pooling config turns on no pooling mode").at(&path));
                    }
                    _ => {
                        return Err(KylinError::operator_unsupported(
                            "the pooling config turns on several modes (their concatenation is not implemented)",
                        )
                        .at(&path));
                    }
                });
                dimension = cfg
                    .get("word_embedding_dimension")
                    .or_else(|| cfg.get("embedding_dimension"))
                    .and_then(Value::as_u64)
                    .map(|d| d as usize);
            }
            "Normalize" => normalize = true,
            other => {
                return Err(KylinError::operator_unsupported(format!(
                    "modules.json[{i}] is a `{other}` module, which Kylin does not run (Transformer, Pooling and Normalize are)"
                ))
                .at(&modules_path));
            }
        }
    }
    let pooling = pooling.ok_or_else(|| {
        KylinError::config_invalid("modules.json has no Pooling module, so the embedding is undefined")
            .at(&modules_path)
    })?;
    let bert_config = dir.join("sentence_bert_config.json");
    let mut max_seq_length = if regular_file(&bert_config)? {
        read_json(&bert_config)?.get("max_seq_length").and_then(Value::as_u64).map(|n| n as usize).filter(|&n| n > 0)
    } else {
        None
    };
    // sentence-transformers 6 keeps the limit as the tokenizer's `model_max_length`
    // (transformers writes a huge number there when a tokenizer has no limit).
    let tokenizer_config = dir.join("tokenizer_config.json");
    if max_seq_length.is_none() && regular_file(&tokenizer_config)? {
        max_seq_length = read_json(&tokenizer_config)?
            .get("model_max_length")
            .and_then(Value::as_u64)
            .filter(|&n| n > 0 && n < 1 << 24)
            .map(|n| n as usize);
    }
    let st_config = dir.join("config_sentence_transformers.json");
    let mut prompts = BTreeMap::new();
    let mut default_prompt_name = None;
    if regular_file(&st_config)? {
        let cfg = read_json(&st_config)?;
        if let Some(map) = cfg.get("prompts").and_then(Value::as_object) {
            for (k, v) in map {
                if let Some(text) = v.as_str() {
                    prompts.insert(k.clone(), text.to_string());
                }
            }
        }
        default_prompt_name = cfg.get("default_prompt_name").and_then(Value::as_str).map(str::to_string);
    }
    Ok(Some(SentenceConfig {
        pooling,
        normalize,
        max_seq_length,
        prompts,
        default_prompt_name,
        dimension,
        source: "modules.json".into(),
    }))
}

/// Loads an encoder directory: config, weights (views), sentence-transformers files and tokenizer.
pub fn load_encoder(dir: &Path) -> Result<LoadedEncoder> {
    let config = read_encoder_config(dir)?;
    let mut warnings = Vec::new();
    let index = if regular_file(&dir.join("model.safetensors"))? {
        safetensors_file::open_single(&dir.join("model.safetensors"))?
    } else {
        safetensors_file::open_sharded(&dir.join("model.safetensors.index.json"), &mut warnings)?
    };
    // Bare encoders are saved without a prefix; the classification classes nest them.
    let prefix = ["", "bert.", "roberta.", "model."]
        .into_iter()
        .find(|p| index.raw(&format!("{p}embeddings.word_embeddings.weight")).is_some())
        .ok_or_else(|| {
            KylinError::tensor_missing(
                "tensor 'embeddings.word_embeddings.weight' is missing (also looked under bert., roberta. and model.)",
            )
            .at(dir)
        })?;
    let mut tensors = BTreeMap::new();
    let mut used = std::collections::BTreeSet::new();
    for (role, name, shape) in table(&config) {
        let full = format!("{prefix}{name}");
        tensors.insert(role, bind_one(&index, &full, &shape, dir)?);
        used.insert(full);
    }
    if let Some(labels) = config.num_labels {
        for (role, name, shape) in classifier_table(&config, prefix, labels) {
            tensors.insert(role, bind_one(&index, &name, &shape, dir)?);
            used.insert(name);
        }
    }
    let unused: Vec<&str> = index
        .names()
        .filter(|n| !used.contains(*n) && !n.ends_with("position_ids") && !n.contains("pooler."))
        .collect();
    if !unused.is_empty() {
        warnings.push(format!("{} tensors are not used by the encoder: {}", unused.len(), unused.join(", ")));
    }
    let sentence = read_sentence_config(dir)?;
    if let (Some(s), None) = (&sentence, config.num_labels)
        && let Some(d) = s.dimension
        && d != config.hidden
    {
        return Err(KylinError::config_invalid(format!(
            "1_Pooling/config.json word_embedding_dimension {d} differs from config.json hidden_size {}",
            config.hidden
        ))
        .at(dir));
    }
    let tokenizer = tokenizer::load_tokenizer(dir, &mut warnings)?;
    if let Some(t) = &tokenizer
        && t.vocab_size > config.vocab_size
    {
        return Err(KylinError::vocab_mismatch(format!(
            "the tokenizer produces ids up to {} but config.json vocab_size is {}",
            t.vocab_size - 1,
            config.vocab_size
        ))
        .at(dir));
    }
    Ok(LoadedEncoder {
        dir: dir.to_path_buf(),
        config,
        tensors,
        sentence,
        tokenizer,
        total_bytes: index.tensor_bytes(),
        warnings,
    })
}
