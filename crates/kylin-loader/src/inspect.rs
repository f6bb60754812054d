//! The `inspect` report: what a model path holds, validated, in one serialisable value.
//!
//! For Hugging Face formats and llama2.c `.bin` files the report comes from a full
//! [`crate::load`] (config resolved, every shard mapped and validated, every tensor bound,
//! tokenizer read), so a model that inspects cleanly also loads. Nothing is read in full: the
//! weights stay in their maps (a `.bin`'s q/k, and a version 2's matrices, are copied as loading
//! does). For GGUF the report comes from the bounded header reader in [`crate::gguf`].

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::generation::GenerationDefaults;
use crate::gguf::{GgufInfo, read_gguf_info};
use crate::llama2c::BinInfo;
use crate::safetensors_file::WeightFile;
use crate::tokenizer::SpecialToken;
use crate::weights::HeadBinding;
use crate::{Format, LoadOptions, Result, detect, load};

/// How the weights bound to the model.
#[derive(Debug, Clone, Serialize)]
pub struct BindingReport {
    pub head: HeadBinding,
    /// Tensors of the table that were bound (a tied head counts once).
    pub bound_tensors: usize,
    /// Checkpoint tensors the architecture's table did not use.
    pub unused_tensors: Vec<String>,
    /// Parts of the checkpoint the native engine does not run (a vision tower, Qwen3.5's
    /// multi-token-prediction head), with their tensors.
    pub not_run: Vec<crate::NotRun>,
    /// The vision tower Kylin runs for images in the prompt, if the checkpoint has one.
    pub vision: Option<crate::vision::VisionConfig>,
    /// What the model serves: generation, embeddings or reranking ([`crate::task`]).
    pub task: crate::task::ModelTask,
    /// Stored dtype -> count of the matrices of the matrix products ([`crate::ModelWeights::matrices`]).
    pub matrix_dtypes: BTreeMap<String, usize>,
    /// How each kind of tensor is stored, and the bytes one token reads.
    pub quantization: QuantizationReport,
}

/// How each kind of tensor is stored (a stored quantization names its format), and what a token
/// reads: every matrix and vector once and one embedding row.
#[derive(Debug, Clone, Serialize)]
pub struct QuantizationReport {
    /// The checkpoint's `quantization_config`, described; `None` for float checkpoints.
    pub stored: Option<String>,
    /// Kind (`attention`, `mlp`, `lm_head`, `embedding`, `norms`, `biases`) -> its storage
    /// (`BF16`, `Q8_0`, ...; several joined with `+`).
    pub kinds: BTreeMap<String, String>,
    pub bytes_per_token: u64,
}

/// How a bound matrix is stored: `Q8_0` planes (F16 scales), `Q4_K`, `Q5_0` or `Q6_0` planes
/// (U8 scales; the columns are an eighth of the quants plane's row), else its dtype.
fn stored_format(w: &crate::ModelWeights, t: &crate::WeightTensor) -> String {
    if let Some(m) = w.published_matrix(t) {
        return match &m.scheme {
            crate::published::Scheme::Int { bits, group: Some(g), .. } => format!("int{bits}/g{g}"),
            crate::published::Scheme::Int { bits, group: None, .. } => format!("int{bits}/channel"),
            crate::published::Scheme::Float8 { .. } => "F8_E4M3".to_string(),
            crate::published::Scheme::Mxfp4 => "MXFP4".to_string(),
        };
    }
    match w.scales.get(&t.name) {
        Some(scale) if scale.dtype == crate::DType::U8 => {
            let cols = t.shape.get(1).map_or(0, |c| c / 8);
            let scale_cols = scale.shape.get(1).copied().unwrap_or(0);
            crate::config::StoredQuantization::byte_scales_format(cols, scale_cols).to_string()
        }
        Some(_) => "Q8_0".to_string(),
        None => t.dtype.as_str().to_string(),
    }
}

/// The quantization report of bound weights.
pub fn quantization_report(config: &crate::ModelConfig, w: &crate::ModelWeights) -> QuantizationReport {
    let mut kinds: BTreeMap<String, std::collections::BTreeSet<String>> = BTreeMap::new();
    let mut add = |kind: &str, t: &crate::WeightTensor| {
        let storage = stored_format(w, t);
        kinds.entry(kind.to_string()).or_default().insert(storage);
    };
    let mut bytes: u64 = 0;
    let plane = |t: &crate::WeightTensor| {
        let published = w.published_matrix(t).map_or(0, |m| {
            [Some(&m.scale), m.zero.as_ref(), m.g_idx.as_ref()].into_iter().flatten().map(|x| x.byte_len() as u64).sum()
        });
        t.byte_len() as u64 + w.scales.get(&t.name).map_or(0, |s| s.byte_len() as u64) + published
    };
    for l in &w.layers {
        use crate::arch::Role;
        for (&role, t) in &l.tensors {
            let kind = match role {
                Role::QProj | Role::KProj | Role::VProj | Role::OProj => "attention",
                Role::GateProj | Role::UpProj | Role::DownProj => "mlp",
                Role::QBias
                | Role::KBias
                | Role::VBias
                | Role::OBias
                | Role::GateBias
                | Role::UpBias
                | Role::DownBias => "biases",
                Role::Router | Role::RouterBias => "router",
                _ if role.is_matrix() => "mlp",
                _ => "norms",
            };
            add(kind, t);
            bytes += if role.is_matrix() { plane(t) } else { t.byte_len() as u64 };
        }
        // A token reads the top k of the layer's experts: k / E of their bytes.
        let mut expert_bytes = 0u64;
        for expert in &l.experts {
            for (&role, t) in expert {
                let matrix = role.is_matrix()
                    || matches!(role, Role::ExpertGateUp | Role::ExpertGateUpInputMajor | Role::ExpertDownInputMajor);
                add(if matrix { "experts" } else { "biases" }, t);
                expert_bytes += if matrix { plane(t) } else { t.byte_len() as u64 };
            }
        }
        if let Some(moe) = config.decoder.moe.filter(|m| m.num_experts > 0 && !l.experts.is_empty()) {
            bytes += expert_bytes / moe.num_experts as u64 * moe.top_k as u64;
        }
    }
    add("norms", &w.final_norm);
    add("embedding", &w.embed_tokens);
    add("lm_head", &w.lm_head);
    bytes += w.final_norm.byte_len() as u64 + plane(&w.lm_head);
    bytes += (config.hidden_size * w.embed_tokens.dtype.size_in_bytes()) as u64;
    QuantizationReport {
        stored: config
            .quantization
            .map(|q| q.describe().to_string())
            .or_else(|| config.published.as_ref().map(|p| p.describe())),
        kinds: kinds.into_iter().map(|(k, v)| (k, v.into_iter().collect::<Vec<_>>().join("+"))).collect(),
        bytes_per_token: bytes,
    }
}

/// The tokenizer as the report shows it.
#[derive(Debug, Clone, Serialize)]
pub struct TokenizerReport {
    /// `tokenizer_json`, `vocab_merges`, or the GGUF `tokenizer.ggml.model`.
    pub kind: String,
    /// Ids the tokenizer can produce.
    pub vocab_size: usize,
    pub bos: Option<SpecialToken>,
    pub eos: Option<SpecialToken>,
    /// Every id that ends generation (generation_config, config and tokenizer EOS together).
    pub eos_ids: Vec<u32>,
    pub add_bos_token: bool,
    pub special_token_count: usize,
    pub has_chat_template: bool,
    /// Names of the chat templates (`default`, `tool_use`, ...).
    pub chat_templates: Vec<String>,
}

/// Everything `kylin inspect` prints.
#[derive(Debug, Clone, Serialize)]
pub struct InspectReport {
    pub path: PathBuf,
    /// `hf-dir`, `safetensors`, `gguf` or `llama2c-bin`.
    pub format: String,
    /// The backend that runs this format: `kylin` or `llama.cpp`.
    pub backend: String,
    /// `architectures[0]` (HF) or `general.architecture` (GGUF).
    pub architecture: String,
    pub model_type: String,
    /// Resolved values: hidden_size, num_layers, num_heads, num_kv_heads, head_dim,
    /// intermediate_size, vocab_size, rope, rms_norm_eps, tie_word_embeddings,
    /// max_position_embeddings, and the architecture's choices.
    pub config: Value,
    /// config.json fields that were absent and took their default.
    pub defaulted: Vec<String>,
    pub files: Vec<WeightFile>,
    pub tensor_count: u64,
    pub total_bytes: u64,
    /// Stored dtype (or GGUF quantization type) -> tensor count.
    pub dtypes: BTreeMap<String, usize>,
    pub binding: Option<BindingReport>,
    pub tokenizer: Option<TokenizerReport>,
    pub generation_defaults: GenerationDefaults,
    /// GGUF details (version, file type, selected metadata); `None` for other formats.
    pub gguf: Option<Value>,
    /// llama2.c details (version, header, tensors and their sizes, what loading copies); `None`
    /// for other formats.
    pub llama2c: Option<BinInfo>,
    pub warnings: Vec<String>,
    /// Wall time of the inspection in milliseconds.
    pub inspect_ms: f64,
}

/// Validates the model at `path` and describes it.
pub fn inspect(path: &Path, opts: &LoadOptions) -> Result<InspectReport> {
    let started = Instant::now();
    let format = detect(path)?;
    let mut report = match &format {
        Format::Gguf { file } => gguf_report(&read_gguf_info(file)?),
        _ => native_report(path, opts)?,
    };
    report.inspect_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(report)
}

/// The resolved config as JSON, with the RoPE scaling parameters flattened next to `type`.
fn config_json(config: &crate::ModelConfig) -> Value {
    let mut value = serde_json::to_value(config).unwrap_or(Value::Null);
    if let Value::Object(obj) = &mut value {
        obj.remove("defaulted");
        // The decoder's choices as `inspect` shows them, besides the full spec.
        let described: Vec<Value> = config.decoder.describe().into_iter().map(Value::String).collect();
        obj.insert("decoder_summary".into(), Value::Array(described));
        if let Some(Value::Object(rope)) = obj.remove("rope") {
            let mut flat = Map::new();
            if let Some(Value::Object(scaling)) = rope.get("scaling") {
                flat.extend(scaling.clone());
            }
            for (k, v) in rope {
                if k != "scaling" {
                    flat.insert(k, v);
                }
            }
            obj.insert("rope".into(), Value::Object(flat));
        }
    }
    value
}

/// The report of a model the native engine loads (Hugging Face formats and llama2.c `.bin`).
fn native_report(path: &Path, opts: &LoadOptions) -> Result<InspectReport> {
    let model = load(path, opts)?;
    let tokenizer = model.tokenizer.as_ref().map(|t| TokenizerReport {
        kind: serde_json::to_value(t.kind).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default(),
        vocab_size: t.vocab_size,
        bos: t.bos_token.clone(),
        eos: t.eos_token.clone(),
        eos_ids: model.eos_ids.clone(),
        add_bos_token: t.add_bos_token,
        special_token_count: t.special_tokens.len(),
        has_chat_template: !t.chat_templates.is_empty(),
        chat_templates: t.chat_templates.iter().map(|c| c.name.clone()).collect(),
    });
    let bound_tensors = model.weights.tensors().len();
    Ok(InspectReport {
        path: path.to_path_buf(),
        format: model.format.name().to_string(),
        backend: "kylin".into(),
        architecture: model.config.architecture.hf_name().to_string(),
        model_type: model.config.model_type.clone(),
        config: config_json(&model.config),
        defaulted: model.config.defaulted.clone(),
        files: model.files.clone(),
        tensor_count: model.tensor_count as u64,
        total_bytes: model.total_bytes,
        dtypes: model.dtypes.clone(),
        binding: Some(BindingReport {
            head: model.weights.head.clone(),
            bound_tensors,
            unused_tensors: model.unused_tensors.clone(),
            not_run: model.not_run.clone(),
            vision: model.vision.as_ref().map(|v| v.config.clone()),
            task: model.task.clone(),
            matrix_dtypes: model.weights.matrices().fold(BTreeMap::new(), |mut counts, t| {
                let dtype = stored_format(&model.weights, t);
                *counts.entry(dtype.to_string()).or_insert(0) += 1;
                counts
            }),
            quantization: quantization_report(&model.config, &model.weights),
        }),
        tokenizer,
        generation_defaults: model.generation.clone(),
        gguf: None,
        llama2c: model.llama2c.clone(),
        warnings: model.warnings.clone(),
        inspect_ms: 0.0,
    })
}

fn gguf_report(info: &GgufInfo) -> InspectReport {
    let arch = info.architecture.clone().unwrap_or_else(|| "unknown".into());
    let hidden = info.arch_u64("embedding_length");
    let heads = info.arch_u64("attention.head_count");
    let head_dim = info.arch_u64("attention.key_length").or_else(|| Some(hidden? / heads.filter(|&h| h > 0)?));
    let rope_type = info
        .metadata
        .get(&format!("{arch}.rope.scaling.type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default")
        .to_string();
    let config = json!({
        "hidden_size": hidden,
        "num_layers": info.arch_u64("block_count"),
        "num_heads": heads,
        "num_kv_heads": info.arch_u64("attention.head_count_kv").or(heads),
        "head_dim": head_dim,
        "intermediate_size": info.arch_u64("feed_forward_length"),
        "vocab_size": info.vocab_size,
        "max_position_embeddings": info.arch_u64("context_length"),
        "rms_norm_eps": info.arch_f64("attention.layer_norm_rms_epsilon"),
        "rope": {
            "type": rope_type,
            "theta": info.arch_f64("rope.freq_base"),
            "factor": info.arch_f64("rope.scaling.factor"),
        },
        "tie_word_embeddings": info.tied_output,
    });
    let mut eos_ids: Vec<u32> =
        [info.eos_token_id, info.metadata.get("tokenizer.ggml.eot_token_id").and_then(|v| v.as_u64())]
            .into_iter()
            .flatten()
            .filter_map(|v| u32::try_from(v).ok())
            .collect();
    eos_ids.sort_unstable();
    eos_ids.dedup();
    let token_text = |id: Option<u64>| -> Option<SpecialToken> {
        let id = u32::try_from(id?).ok()?;
        Some(SpecialToken { content: String::new(), id })
    };
    let tokenizer = info.vocab_size.map(|v| TokenizerReport {
        kind: info.tokenizer_model.clone().unwrap_or_else(|| "unknown".into()),
        vocab_size: v as usize,
        bos: token_text(info.bos_token_id),
        eos: token_text(info.eos_token_id),
        eos_ids,
        add_bos_token: info.add_bos_token.unwrap_or(false),
        special_token_count: 0,
        has_chat_template: info.chat_template.is_some(),
        chat_templates: info.chat_template.iter().map(|_| "default".to_string()).collect(),
    });
    let mut warnings = Vec::new();
    if tokenizer.is_none() {
        warnings.push("the GGUF file has no tokenizer.ggml.tokens: it can only be run from token ids".into());
    }
    let selected: Map<String, Value> = info
        .metadata
        .iter()
        .filter(|(k, _)| !k.starts_with("tokenizer.ggml.") && k.as_str() != "tokenizer.chat_template")
        .map(|(k, v)| (k.clone(), Value::String(v.short())))
        .collect();
    InspectReport {
        path: info.path.clone(),
        format: "gguf".into(),
        backend: "llama.cpp".into(),
        architecture: arch.clone(),
        model_type: arch,
        config,
        defaulted: Vec::new(),
        files: vec![WeightFile { path: info.path.clone(), bytes: info.file_bytes }],
        tensor_count: info.tensor_count,
        total_bytes: info.tensor_bytes,
        dtypes: info.tensor_types.clone(),
        binding: None,
        tokenizer,
        generation_defaults: GenerationDefaults::default(),
        gguf: Some(json!({
            "version": info.version,
            "name": info.name,
            "file_type": info.file_type,
            "quantization_types": info.tensor_types.keys().collect::<Vec<_>>(),
            "alignment": info.alignment,
            "data_offset": info.data_offset,
            "metadata": selected,
        })),
        llama2c: None,
        warnings,
        inspect_ms: 0.0,
    }
}

fn mib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// A byte count in KiB below one MiB, else as [`mib`] shows it.
fn size(bytes: u64) -> String {
    if bytes < 1 << 20 { format!("{:.1} KiB", bytes as f64 / 1024.0) } else { mib(bytes) }
}

fn show(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => "-".into(),
        other => other.to_string(),
    }
}

impl InspectReport {
    /// The human-readable summary `kylin inspect` prints.
    pub fn to_human(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(s, "model       {}", self.path.display());
        let _ = writeln!(s, "format      {} (runs on {})", self.format, self.backend);
        let _ = writeln!(s, "arch        {} (model_type {})", self.architecture, self.model_type);
        if let Value::Object(c) = &self.config {
            let _ = writeln!(s, "config");
            for key in [
                "hidden_size",
                "num_layers",
                "num_heads",
                "num_kv_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
                "max_position_embeddings",
                "rms_norm_eps",
                "tie_word_embeddings",
                "qkv_bias",
                "o_bias",
                "mlp_bias",
                "hidden_act",
                "declared_dtype",
            ] {
                if let Some(v) = c.get(key) {
                    let note = if self.defaulted.iter().any(|d| d == key) { "  (default)" } else { "" };
                    let _ = writeln!(s, "  {key:<24} {}{note}", show(v));
                }
            }
            if let Some(Value::Array(parts)) = c.get("decoder_summary")
                && !parts.is_empty()
            {
                let parts: Vec<String> = parts.iter().filter_map(|p| p.as_str().map(str::to_string)).collect();
                let _ = writeln!(s, "  {:<24} {}", "decoder", parts.join("; "));
            }
            if let Some(Value::Object(rope)) = c.get("rope") {
                let parts: Vec<String> =
                    rope.iter().filter(|(_, v)| !v.is_null()).map(|(k, v)| format!("{k}={}", show(v))).collect();
                let _ = writeln!(s, "  {:<24} {}", "rope", parts.join(", "));
            }
            let rope_defaults: Vec<&str> =
                self.defaulted.iter().filter(|d| d.starts_with("rope")).map(String::as_str).collect();
            if !rope_defaults.is_empty() {
                let _ = writeln!(s, "  {:<24} {}", "rope defaults", rope_defaults.join(", "));
            }
        }
        let _ = writeln!(
            s,
            "weights     {} file(s), {} tensors, {}",
            self.files.len(),
            self.tensor_count,
            mib(self.total_bytes)
        );
        for f in self.files.iter().take(8) {
            let _ = writeln!(s, "  {} ({})", f.path.display(), mib(f.bytes));
        }
        if self.files.len() > 8 {
            let _ = writeln!(s, "  ... and {} more", self.files.len() - 8);
        }
        let dtypes: Vec<String> = self.dtypes.iter().map(|(k, v)| format!("{k} x{v}")).collect();
        let _ = writeln!(s, "  dtypes: {}", dtypes.join(", "));
        if let Some(b) = &self.binding {
            let _ = writeln!(s, "binding     {} tensors bound; head: {}", b.bound_tensors, b.head.reason);
            match &b.task {
                crate::task::ModelTask::Generate => {}
                crate::task::ModelTask::Embed(e) => {
                    let _ = writeln!(
                        s,
                        "task        embeddings (from {}): last-token pooling{}",
                        e.source,
                        if e.normalize { ", normalised" } else { "" }
                    );
                }
                crate::task::ModelTask::Rerank(r) => {
                    let _ = writeln!(
                        s,
                        "task        reranking (from {}): P(yes) over ids yes={} no={}",
                        r.source, r.yes_id, r.no_id
                    );
                }
            }
            if !b.unused_tensors.is_empty() {
                let _ = writeln!(s, "  unused: {}", b.unused_tensors.join(", "));
            }
            if let Some(v) = &b.vision {
                let (k, p) = (v.spatial_merge_size, v.patch_size);
                let shape = match v.kind {
                    crate::vision::VisionKind::Qwen35 => format!("patches {p}x{p}, {k}x{k} merged into one token"),
                    crate::vision::VisionKind::Gemma3 { image_size, tokens_per_image } => format!(
                        "{image_size}x{image_size} images in patches {p}x{p}, {k}x{k} pooled: {tokens_per_image} tokens"
                    ),
                    crate::vision::VisionKind::Gemma4 { attention, .. } => format!(
                        "image tokens {}; variable-resolution images in patches {p}x{p}, {k}x{k} pooled into one token",
                        match attention {
                            crate::vision::ImageAttention::BidirectionalOnSliding => "bidirectional on sliding layers",
                            _ => "causal",
                        }
                    ),
                };
                let _ = writeln!(
                    s,
                    "  vision tower: {} ({} blocks, width {}, {} heads, {shape} of width {}): images run",
                    v.model_type, v.depth, v.hidden, v.heads, v.out_hidden
                );
            }
            for part in &b.not_run {
                let shown: Vec<&str> = part.tensors.iter().take(6).map(String::as_str).collect();
                let more = part.tensors.len().saturating_sub(shown.len());
                let _ = writeln!(
                    s,
                    "  not run: {}, {} tensors: {}{}",
                    part.part,
                    part.tensors.len(),
                    shown.join(", "),
                    if more > 0 { format!(", ... and {more} more") } else { String::new() }
                );
            }
            let q = &b.quantization;
            let kinds: Vec<String> = q.kinds.iter().map(|(k, v)| format!("{k} {v}")).collect();
            let _ = writeln!(
                s,
                "storage     {}; {} read per token{}",
                kinds.join(", "),
                mib(q.bytes_per_token),
                q.stored.as_ref().map_or(String::new(), |d| format!("; stored quantized: {d}"))
            );
        }
        if let Some(g) = &self.gguf {
            let _ = writeln!(
                s,
                "gguf        version {}, file type {}, quantization types {}",
                show(&g["version"]),
                show(&g["file_type"]),
                show(&g["quantization_types"])
            );
        }
        if let Some(b) = &self.llama2c {
            let h = &b.header;
            let kind = match h.version {
                0 => "float32, 28-byte header, no magic",
                1 => "float32, 256-byte 'ak42' header",
                _ => "Q8_0, 256-byte 'ak42' header",
            };
            let _ = writeln!(s, "llama2.c    version {} ({kind})", h.version);
            let _ = writeln!(s, "  header: {}", h.describe());
            for t in &b.tensors {
                let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
                let count = if t.count > 1 { format!("{} x ", t.count) } else { String::new() };
                let shape = format!("{count}[{}]", dims.join(", "));
                let hf = t.hf_name.as_deref().unwrap_or("(skipped)");
                let _ = writeln!(
                    s,
                    "  {:<15} {shape:<20} {:<5} {:>10}  -> {hf}",
                    t.name,
                    t.encoding.as_str(),
                    size(t.bytes)
                );
            }
            let _ = writeln!(s, "  copied at load: {}", size(b.owned_bytes));
            for n in &b.notes {
                let _ = writeln!(s, "  - {n}");
            }
        }
        match &self.tokenizer {
            Some(t) => {
                let tok = |t: &Option<SpecialToken>| match t {
                    Some(t) if t.content.is_empty() => t.id.to_string(),
                    Some(t) => format!("{:?} ({})", t.content, t.id),
                    None => "-".into(),
                };
                let _ = writeln!(s, "tokenizer   {}, {} ids, {} special", t.kind, t.vocab_size, t.special_token_count);
                let _ = writeln!(s, "  bos {} (add_bos_token {}), eos {}", tok(&t.bos), t.add_bos_token, tok(&t.eos));
                let _ = writeln!(s, "  eos ids {:?}", t.eos_ids);
                let _ = writeln!(
                    s,
                    "  chat template: {}",
                    if t.has_chat_template { t.chat_templates.join(", ") } else { "none".into() }
                );
            }
            None => {
                let _ = writeln!(s, "tokenizer   none");
            }
        }
        let g = &self.generation_defaults;
        let opt = |v: Option<String>| v.unwrap_or_else(|| "-".into());
        let _ = writeln!(
            s,
            "sampling    do_sample {}, temperature {}, top_k {}, top_p {}, min_p {}, repetition_penalty {}, max_new_tokens {}",
            opt(g.do_sample.map(|v| v.to_string())),
            opt(g.temperature.map(|v| v.to_string())),
            opt(g.top_k.map(|v| v.to_string())),
            opt(g.top_p.map(|v| v.to_string())),
            opt(g.min_p.map(|v| v.to_string())),
            opt(g.repetition_penalty.map(|v| v.to_string())),
            opt(g.max_new_tokens.map(|v| v.to_string())),
        );
        if self.warnings.is_empty() {
            let _ = writeln!(s, "warnings    none");
        } else {
            let _ = writeln!(s, "warnings");
            for w in &self.warnings {
                let _ = writeln!(s, "  - {w}");
            }
        }
        let _ = writeln!(s, "checked in {:.0} ms", self.inspect_ms);
        s
    }
}
