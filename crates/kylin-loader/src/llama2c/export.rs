//! Writing llama2.c `.bin` files from a loaded Llama (`kylin convert --to bin-v0|bin-v1|bin-v2`),
//! and Hugging Face directories from a loaded `.bin` (`kylin convert --to hf`).
//!
//! The `.bin` writer follows llama2.c's `export.py` byte for byte: the layouts of
//! [`super`], `q_proj`/`k_proj` rows permuted into llama2.c's interleaved RoPE order, version 0's
//! `freq_cis` tables, and version 2's `quantize_q80` (per group of `group_size` values: scale =
//! max |w| / 127, values rounded half to even; the group size is 64, halved until it divides
//! `dim`). Weights stored as BF16 or F16 are widened to f32 exactly. What the format cannot hold
//! is refused with `OPERATOR_UNSUPPORTED`, naming the tensor or config field: biases, Qwen3's
//! q/k norms, RoPE scaling, another architecture, a `head_dim` other than `hidden_size /
//! num_attention_heads`, and (version 0 only, which has no room for them) a RoPE base or epsilon
//! other than llama2.c's; versions 1 and 2 keep those in Kylin's header extension.
//!
//! The Hugging Face writer needs nothing of the format: a loaded `.bin` is already bound in
//! Hugging Face's layout (q/k un-permuted), so it writes `config.json` and every bound tensor
//! under its Hugging Face name into `model.safetensors`, in the stored dtype (F32).
//!
//! Every file is written under a temporary name beside its destination and renamed when
//! complete, so an interrupted conversion never leaves a file that looks whole.

use std::borrow::Cow;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value, json};

use super::{BinHeader, Encoding, Part, RMS_NORM_EPS, ROPE_THETA, Section, hf_row_of_bin_row};
use crate::LoadedModel;
use crate::arch::{self, Role};
use crate::config::{Architecture, ModelConfig, RopeScaling};
use crate::error::{ErrorCode, KylinError, Result};
use crate::tensor::{DType, WeightTensor};
use crate::tokenizer::TokenizerKind;
use crate::weights::ModelWeights;

/// `export.py`'s default Q8_0 group size.
pub const DEFAULT_GROUP_SIZE: usize = 64;

/// The header a model would be written with as `version` (0, 1 or 2), or `OPERATOR_UNSUPPORTED`
/// listing everything the format cannot hold.
pub fn header_for(config: &ModelConfig, weights: &ModelWeights, version: u32) -> Result<BinHeader> {
    let mut problems: Vec<String> = Vec::new();
    let name = |role: Role| arch::tensor_name(config.architecture, role, 0).unwrap_or_else(|| format!("{role:?}"));
    if config.architecture != Architecture::LLAMA {
        problems.push(format!(
            "architecture {} (config.json architectures[0]; the format holds the Llama block only)",
            config.architecture.hf_name()
        ));
    }
    if config.qkv_bias {
        problems.push(format!("tensor '{}' and every layer's q/k/v biases", name(Role::QBias)));
    }
    if config.o_bias {
        problems.push(format!("tensor '{}' and every layer's output-projection bias", name(Role::OBias)));
    }
    if config.mlp_bias {
        problems.push(format!("tensor '{}' and every layer's MLP biases", name(Role::GateBias)));
    }
    if config.decoder.qk_norm != crate::family::QkNorm::None {
        problems.push(format!(
            "tensors '{}' and '{}' of every layer (per-head q/k RMSNorm)",
            name(Role::QNorm),
            name(Role::KNorm)
        ));
    }
    if config.rope.scaling != RopeScaling::Default {
        let kind = serde_json::to_value(&config.rope.scaling)
            .ok()
            .and_then(|v| v.get("type").and_then(Value::as_str).map(str::to_string))
            .unwrap_or_default();
        problems.push(format!("config field rope_parameters.rope_type '{kind}' (llama2.c's RoPE is unscaled)"));
    }
    if config.head_dim * config.num_heads != config.hidden_size {
        problems.push(format!(
            "config field head_dim {} (the format derives it as hidden_size / num_attention_heads = {} / {})",
            config.head_dim, config.hidden_size, config.num_heads
        ));
    }
    let custom = config.rope.theta != ROPE_THETA || config.rms_norm_eps != RMS_NORM_EPS;
    if version == 0 && config.rope.theta != ROPE_THETA {
        problems.push(format!(
            "config field rope_theta {} (version 0 has no field for it and llama2.c uses {ROPE_THETA}; bin-v1 and \
             bin-v2 keep it in Kylin's header extension)",
            config.rope.theta
        ));
    }
    if version == 0 && config.rms_norm_eps != RMS_NORM_EPS {
        problems.push(format!(
            "config field rms_norm_eps {} (version 0 has no field for it and llama2.c uses {RMS_NORM_EPS}; bin-v1 \
             and bin-v2 keep it in Kylin's header extension)",
            config.rms_norm_eps
        ));
    }
    if !problems.is_empty() {
        return Err(KylinError::operator_unsupported(format!(
            "the llama2.c format cannot hold this model: {}",
            problems.join("; ")
        )));
    }
    let group_size = (version == 2).then(|| {
        let mut gs = DEFAULT_GROUP_SIZE;
        while !config.hidden_size.is_multiple_of(gs) {
            gs /= 2;
        }
        gs
    });
    Ok(BinHeader {
        version,
        dim: config.hidden_size,
        hidden_dim: config.intermediate_size,
        n_layers: config.num_layers,
        n_heads: config.num_heads,
        n_kv_heads: config.num_kv_heads,
        vocab_size: config.vocab_size,
        seq_len: config.max_position_embeddings,
        shared_classifier: weights.head.tied,
        group_size,
        rope_theta: (custom && version > 0).then_some(config.rope.theta),
        rms_norm_eps: (custom && version > 0).then_some(config.rms_norm_eps),
    })
}

/// The bound tensor playing `role` in `layer`.
fn tensor_of(w: &ModelWeights, role: Role, layer: usize) -> Option<&WeightTensor> {
    let l = w.layers.get(layer);
    match role {
        Role::Embed => Some(&w.embed_tokens),
        Role::FinalNorm => Some(&w.final_norm),
        Role::LmHead => Some(&w.lm_head),
        role => l.and_then(|l| l.get(role)),
    }
}

/// Appends row `row` of `t` (of `cols` elements) to `out`, widened to f32.
fn widen_row(t: &WeightTensor, row: usize, cols: usize, out: &mut Vec<f32>) {
    let size = t.dtype.size_in_bytes();
    let bytes = &t.bytes()[row * cols * size..(row + 1) * cols * size];
    match t.dtype {
        DType::F32 => out.extend(bytes.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))),
        DType::BF16 => out.extend(bytes.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())),
        DType::F16 => out.extend(bytes.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())),
        // Bound tensors are float (the binder refuses the others).
        DType::I8 | DType::U8 | DType::F8E4M3 | DType::I32 | DType::I64 => {}
    }
}

/// A section's values in llama2.c's order, as f32.
fn section_values(h: &BinHeader, weights: &ModelWeights, s: &Section, out: &mut Vec<f32>) -> Result<()> {
    out.clear();
    let (rows, cols) = match s.shape[..] {
        [rows, cols] => (rows, cols),
        [len] => (1, len),
        _ => (0, 0),
    };
    if let Some(role) = s.part.role() {
        let t = tensor_of(weights, role, s.layer.unwrap_or(0)).ok_or_else(|| {
            KylinError::tensor_missing(format!("internal: no bound tensor for llama2.c's {}", s.part.name()))
        })?;
        if t.element_count() != rows * cols || t.shape.last() != Some(&cols) {
            return Err(KylinError::tensor_shape_mismatch(format!(
                "tensor '{}' has shape {:?}; llama2.c's {} needs {:?}",
                t.name,
                t.shape,
                s.part.name(),
                s.shape
            )));
        }
        let permuted = matches!(s.part, Part::Wq | Part::Wk);
        out.reserve(rows * cols);
        for r in 0..rows {
            // llama2.c row r holds HF row hf_row_of_bin_row(r): walk the inverse map.
            let src = if permuted { hf_row_of_bin_row(r, h.head_size()) } else { r };
            widen_row(t, src, cols, out);
        }
        return Ok(());
    }
    // Version 0's RoPE tables, as model.py's precompute_freqs_cis(head_size, 2 * seq_len)[:seq_len]
    // computes them in float32 (llama2.c's run.c skips them; they are written for fidelity).
    let head_size = h.head_size();
    let freqs: Vec<f32> =
        (0..cols).map(|i| 1.0 / (ROPE_THETA as f32).powf((2 * i) as f32 / head_size as f32)).collect();
    for t in 0..rows {
        for &f in &freqs {
            let angle = t as f32 * f;
            out.push(if s.part == Part::FreqCisReal { angle.cos() } else { angle.sin() });
        }
    }
    Ok(())
}

/// Writes f32 values little-endian.
fn write_f32s(w: &mut impl Write, values: &[f32]) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(4 * 4096);
    for chunk in values.chunks(4096) {
        buf.clear();
        for v in chunk {
            buf.extend_from_slice(&v.to_le_bytes());
        }
        w.write_all(&buf)?;
    }
    Ok(())
}

/// `export.py`'s `quantize_q80`: int8 values and one f32 scale per group. A group of zeros has
/// scale 0 and values 0 (where PyTorch would divide by zero).
pub fn quantize_q8_0(values: &[f32], group_size: usize) -> (Vec<i8>, Vec<f32>) {
    let mut q = Vec::with_capacity(values.len());
    let mut scales = Vec::with_capacity(values.len() / group_size.max(1));
    for group in values.chunks(group_size.max(1)) {
        let wmax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let scale = wmax / 127.0;
        scales.push(scale);
        q.extend(group.iter().map(|&v| if scale == 0.0 { 0 } else { (v / scale).round_ties_even() as i8 }));
    }
    (q, scales)
}

/// A file being written under a temporary name, renamed into place by [`Staged::finish`].
struct Staged {
    tmp: PathBuf,
    dest: PathBuf,
}

impl Staged {
    fn new(dest: &Path) -> Staged {
        let mut name = dest.file_name().map(|n| n.to_os_string()).unwrap_or_default();
        name.push(".kylin-partial");
        Staged { tmp: dest.with_file_name(name), dest: dest.to_path_buf() }
    }

    fn finish(self) -> Result<()> {
        std::fs::rename(&self.tmp, &self.dest).map_err(|e| KylinError::io(&self.dest, "cannot write", &e))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        // Nothing to do after `finish` (the temporary name is gone); after a failure, the partial file goes.
        let _ = std::fs::remove_file(&self.tmp);
    }
}

/// Writes `model` as a llama2.c checkpoint of `version` (0, 1 or 2) to `out`; returns the header.
pub fn write_bin(model: &LoadedModel, version: u32, out: &Path) -> Result<BinHeader> {
    let header = header_for(&model.config, &model.weights, version)?;
    let sections = header.sections()?;
    let staged = Staged::new(out);
    let io = |e: std::io::Error| KylinError::io(out, "cannot write", &e);
    let file = File::create(&staged.tmp).map_err(|e| KylinError::io(&staged.tmp, "cannot create", &e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    w.write_all(&header.to_bytes()?).map_err(io)?;
    let mut values = Vec::new();
    for s in &sections {
        section_values(&header, &model.weights, s, &mut values)?;
        match s.encoding {
            Encoding::F32 => write_f32s(&mut w, &values).map_err(io)?,
            Encoding::Q8_0 => {
                let (q, scales) = quantize_q8_0(&values, header.group_size.unwrap_or(DEFAULT_GROUP_SIZE));
                let bytes: Vec<u8> = q.iter().map(|&v| v as u8).collect();
                w.write_all(&bytes).map_err(io)?;
                write_f32s(&mut w, &scales).map_err(io)?;
            }
        }
    }
    w.flush().map_err(io)?;
    drop(w);
    staged.finish()?;
    Ok(header)
}

/// A bound tensor as a safetensors view.
struct View<'a>(&'a WeightTensor);

impl safetensors::View for View<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        self.0.dtype.safetensors_dtype()
    }

    fn shape(&self) -> &[usize] {
        &self.0.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.0.bytes())
    }

    fn data_len(&self) -> usize {
        self.0.byte_len()
    }
}

/// `config.json` for a Llama as Kylin resolved it.
fn hf_config(model: &LoadedModel) -> Value {
    let c = &model.config;
    let dtype = model.weights.embed_tokens.dtype;
    let mut obj = json!({
        "architectures": [c.architecture.hf_name()],
        "model_type": c.model_type,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "hidden_act": c.hidden_act,
        "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": match dtype { DType::BF16 => "bfloat16", DType::F16 => "float16", _ => "float32" },
    });
    let bos = model.tokenizer.as_ref().and_then(|t| t.bos_token.as_ref()).map(|t| t.id).or(c.bos_token_id);
    if let (Some(o), Some(b)) = (obj.as_object_mut(), bos) {
        o.insert("bos_token_id".into(), json!(b));
    }
    if let Some(o) = obj.as_object_mut() {
        match model.eos_ids[..] {
            [] => {}
            [one] => {
                o.insert("eos_token_id".into(), json!(one));
            }
            ref many => {
                o.insert("eos_token_id".into(), json!(many));
            }
        }
    }
    obj
}

fn write_json(path: &Path, value: &Value) -> Result<()> {
    let text = serde_json::to_string_pretty(value).unwrap_or_default();
    std::fs::write(path, text + "\n").map_err(|e| KylinError::io(path, "cannot write", &e))
}

/// Writes `model` (a Llama, as a loaded `.bin` always is) as a Hugging Face directory in
/// `out_dir` (created if needed): `config.json`, `model.safetensors` and, for a model read with
/// llama2.c's `tokenizer.bin`, the same tokenizer as `tokenizer.json` + `tokenizer_config.json`.
/// Returns the names of the files written.
pub fn write_hf(model: &LoadedModel, out_dir: &Path) -> Result<Vec<String>> {
    header_for(&model.config, &model.weights, 1)
        .map_err(|e| KylinError::operator_unsupported(format!("--to hf writes Llama models only: {}", e.message)))?;
    std::fs::create_dir_all(out_dir).map_err(|e| KylinError::io(out_dir, "cannot create", &e))?;
    let mut written = Vec::new();

    let config_path = out_dir.join("config.json");
    write_json(&config_path, &hf_config(model))?;
    written.push("config.json".to_string());

    // The safetensors crate writes a temporary file and renames it into place itself.
    let path = out_dir.join("model.safetensors");
    let tensors = model.weights.tensors();
    let mut metadata = std::collections::HashMap::new();
    metadata.insert("format".to_string(), "pt".to_string());
    safetensors::serialize_to_file(tensors.iter().map(|t| (t.name.as_str(), View(t))), Some(metadata), &path)
        .map_err(|e| KylinError::new(ErrorCode::Io, format!("cannot write {}: {e}", path.display())).at(&path))?;
    // Its temporary file is private to the user; give the weights the permissions every other
    // file written here gets (the process's umask).
    if let Ok(meta) = std::fs::metadata(&config_path) {
        let _ = std::fs::set_permissions(&path, meta.permissions());
    }
    written.push("model.safetensors".to_string());

    if let Some(tok) = model.tokenizer.as_ref().filter(|t| t.kind == TokenizerKind::Llama2cBin) {
        let path = out_dir.join("tokenizer.json");
        tok.tokenizer
            .save(&path, true)
            .map_err(|e| KylinError::new(ErrorCode::Io, format!("cannot write {}: {e}", path.display())).at(&path))?;
        written.push("tokenizer.json".to_string());
        let mut cfg = Map::new();
        cfg.insert("tokenizer_class".into(), json!("PreTrainedTokenizerFast"));
        cfg.insert("add_bos_token".into(), json!(tok.add_bos_token));
        cfg.insert("add_eos_token".into(), json!(tok.add_eos_token));
        for (key, t) in [("bos_token", &tok.bos_token), ("eos_token", &tok.eos_token), ("unk_token", &tok.unk_token)] {
            if let Some(t) = t {
                cfg.insert(key.into(), json!(t.content));
            }
        }
        cfg.insert("model_max_length".into(), json!(model.config.max_position_embeddings));
        write_json(&out_dir.join("tokenizer_config.json"), &Value::Object(cfg))?;
        written.push("tokenizer_config.json".to_string());
    }
    Ok(written)
}

/// The tokenizer and generation files a model directory may hold beside its weights.
pub const SIDE_FILES: [&str; 11] = [
    "tokenizer.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
];

/// What [`copy_side_files`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Copied {
    pub copied: Vec<String>,
    /// Sentences about files left alone.
    pub warnings: Vec<String>,
}

/// Copies the [`SIDE_FILES`] present in `from` (and absent from `skip`) into `to`. A file
/// already in `to` with the same bytes is left as is; one with other bytes is not overwritten
/// (it may belong to another model in the same directory) and is reported.
pub fn copy_side_files(from: &Path, to: &Path, skip: &[String]) -> Result<Copied> {
    let mut out = Copied::default();
    for name in SIDE_FILES {
        let src = from.join(name);
        if skip.iter().any(|s| s == name) || !src.is_file() {
            continue;
        }
        let dst = to.join(name);
        let bytes = std::fs::read(&src).map_err(|e| KylinError::io(&src, "cannot read", &e))?;
        match std::fs::read(&dst) {
            Ok(existing) if existing == bytes => continue,
            Ok(_) => {
                out.warnings.push(format!(
                    "{} exists with other contents and was left as is: the converted model will use it, not {}",
                    dst.display(),
                    src.display()
                ));
                continue;
            }
            Err(_) => {}
        }
        std::fs::write(&dst, &bytes).map_err(|e| KylinError::io(&dst, "cannot write", &e))?;
        out.copied.push(name.to_string());
    }
    Ok(out)
}
