//! `kylin quantize MODEL --to q8_0 OUT_DIR`: a Hugging Face directory whose linear layers and
//! head are stored in Kylin's packed Q8_0 planes, which loads in place (no re-quantization, no
//! copy) and computes exactly what `--quantize q8_0` computes on the original.
//!
//! What is written:
//! - `model.safetensors`: every quantized matrix as `X.weight` (U8 `[groups of 16 rows, blocks
//!   of 32 columns, 512]`, the quants) and `X.weight_scale` (F16 `[groups, blocks, 16]`), the
//!   naming compressed-tensors and vLLM use; the head as `lm_head.weight` even when the source
//!   tied it to the embedding; every other bound tensor (embedding, norms, biases) as stored.
//! - `config.json`: the source's, with `quantization_config` (`quant_method: "kylin"`,
//!   `format: "q8_0-packed"`, `version: 1`; `q4_k-packed` is at version 2) and
//!   `tie_word_embeddings: false`.
//! - the tokenizer, chat template and generation config files, copied.
//!
//! The layout is Kylin's own rather than compressed-tensors' `int-quantized` (row-major int8
//! with group scales), because that one would have to be repacked at every load; transformers
//! and vLLM do not read this directory. Files are written under temporary names and renamed
//! once complete, so a failure leaves no half-written model behind.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::Result;
use kylin_engine::QuantFormat;
use kylin_engine::model::Model;
use kylin_kernels::quant::QuantMatrix;
use kylin_loader::{Format, KylinError, LoadOptions, StoredQuantization};
use safetensors::tensor::TensorView;

use crate::args::QuantizeArgs;

pub fn run(args: &QuantizeArgs) -> Result<()> {
    let started = Instant::now();
    let format = args.to.format();
    let threads = match args.threads {
        Some(0) => return Err(KylinError::input_invalid("--threads must be at least 1").into()),
        Some(n) => n,
        None => kylin_kernels::physical_cores(),
    };
    crate::sigbus::watch(&args.model);
    let source_dir = match kylin_loader::detect(&args.model)? {
        Format::HfDir { dir, .. } | Format::SafetensorsFile { dir, .. } => dir,
        Format::LegacyBin { file, .. } => {
            return Err(KylinError::input_invalid(format!(
                "{} is a llama2.c checkpoint; convert it first (kylin convert {} --to hf OUT_DIR), then quantize the directory",
                file.display(),
                file.display()
            ))
            .into());
        }
        Format::Gguf { file } => {
            return Err(KylinError::input_invalid(format!(
                "{} is a GGUF file, already in llama.cpp's formats; kylin quantize reads Hugging Face directories",
                file.display()
            ))
            .into());
        }
    };
    prepare_out_dir(&args.out_dir)?;

    let opts = LoadOptions { tensor_map: args.tensor_map.clone(), require_tokenizer: false, ..LoadOptions::default() };
    let loaded = kylin_loader::load(&args.model, &opts)?;
    if loaded.config.quantization.is_some() {
        return Err(KylinError::input_invalid(format!(
            "{} is already quantized ({}); quantize its BF16, F16 or F32 original",
            args.model.display(),
            loaded.config.quantization.map(StoredQuantization::describe).unwrap_or_default()
        ))
        .into());
    }
    if let Some(published) = &loaded.config.published {
        return Err(KylinError::input_invalid(format!(
            "{} is already quantized ({}); it loads and runs as published (kylin run {}), or quantize its BF16, F16 or F32 original",
            args.model.display(),
            published.describe(),
            args.model.display()
        ))
        .into());
    }
    let family = loaded.config.architecture.family();
    if family.has_fused_projections() {
        return Err(KylinError::operator_unsupported(format!(
            "{} stores fused projections (qkv_proj, gate_up_proj), which a kylin quantize checkpoint cannot hold yet; quantize at load instead (--quantize q8_0|q4_k)",
            family.hf_name
        ))
        .into());
    }
    let mut model = Model::new(&loaded.config, &loaded.weights)?;
    let progress = crate::open::quantize_progress_bar();
    model.quantize(format, threads, &|done, total| (progress.0)(done, total))?;

    // The tensors to write: the quantized planes, then every other bound tensor as stored.
    let quantized = model.quantized_matrices();
    let quantized_names: std::collections::HashSet<&str> = quantized.iter().map(|(n, _)| n.as_str()).collect();
    let mut tensors: Vec<(String, TensorView<'_>)> = Vec::new();
    let view = |dtype, shape: Vec<usize>, data| {
        TensorView::new(dtype, shape, data)
            .map_err(|e| KylinError::input_invalid(format!("cannot describe a tensor: {e}")))
    };
    for (name, m) in &quantized {
        let (quants, scales) = match m {
            QuantMatrix::Q8_0(_) => {
                let (qs, ss) = kylin_kernels::quant::q8_0_plane_shapes(m.rows(), m.cols());
                ((qs.to_vec(), safetensors::Dtype::U8), (ss.to_vec(), safetensors::Dtype::F16))
            }
            QuantMatrix::Q4K(_) => {
                let (qs, ss) = kylin_kernels::q4k::q4_k_plane_shapes(m.rows(), m.cols());
                ((qs.to_vec(), safetensors::Dtype::U8), (ss.to_vec(), safetensors::Dtype::U8))
            }
            QuantMatrix::Q5_0(_) => {
                let (qs, ss) = kylin_kernels::q56::q5_0_plane_shapes(m.rows(), m.cols());
                ((qs.to_vec(), safetensors::Dtype::U8), (ss.to_vec(), safetensors::Dtype::U8))
            }
            QuantMatrix::Q6_0(_) => {
                let (qs, ss) = kylin_kernels::q56::q6_0_plane_shapes(m.rows(), m.cols());
                ((qs.to_vec(), safetensors::Dtype::U8), (ss.to_vec(), safetensors::Dtype::U8))
            }
            // Only a published checkpoint's matrices get these packings, and those are refused
            // above.
            QuantMatrix::Q4G(_)
            | QuantMatrix::Q8_0A16(_)
            | QuantMatrix::Q4GA16(_)
            | QuantMatrix::F8A16(_)
            | QuantMatrix::Mxfp4(_) => {
                return Err(KylinError::operator_unsupported(format!(
                    "{name} is in the {} packing, which kylin quantize does not write",
                    m.packing().name()
                ))
                .into());
            }
        };
        tensors.push((name.clone(), view(quants.1, quants.0, m.quants())?));
        tensors.push((format!("{name}_scale"), view(scales.1, scales.0, m.scales())?));
    }
    for t in loaded.weights.tensors() {
        if quantized_names.contains(t.name.as_str()) {
            continue;
        }
        tensors.push((t.name.clone(), view(t.dtype.safetensors_dtype(), t.shape.clone(), t.bytes())?));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let metadata = HashMap::from([
        ("format".to_string(), "pt".to_string()),
        ("quantized_by".to_string(), format!("kylin {}", env!("CARGO_PKG_VERSION"))),
    ]);
    let weights_path = args.out_dir.join("model.safetensors");
    let partial = args.out_dir.join("model.safetensors.partial");
    safetensors::serialize_to_file(tensors, Some(metadata), &partial)
        .map_err(|e| KylinError::io(&partial, "cannot write", &std::io::Error::other(e.to_string())))?;

    // config.json: the source's, with the quantization recorded.
    let config_path = source_dir.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| KylinError::io(&config_path, "cannot read", &e))?;
    let mut config: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| KylinError::config_invalid(format!("{} is not JSON: {e}", config_path.display())))?;
    let obj = config
        .as_object_mut()
        .ok_or_else(|| KylinError::config_invalid(format!("{} is not a JSON object", config_path.display())))?;
    let quantization_config = match format {
        QuantFormat::Q8_0 => serde_json::json!({
            "quant_method": StoredQuantization::KYLIN_METHOD,
            "format": StoredQuantization::Q8_0_FORMAT,
            "version": StoredQuantization::Q8_0_VERSION,
            "weights": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32, "scale_dtype": "float16"},
            "rows_per_group": 16,
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "group", "group_size": 32, "dynamic": true},
            "quantized_modules": "every linear layer of the decoder and lm_head; embed_tokens as stored",
        }),
        QuantFormat::Published(packing) => {
            return Err(KylinError::operator_unsupported(format!(
                "kylin quantize writes q8_0 or q4_k, not the {} packing of a published checkpoint",
                packing.name()
            ))
            .into());
        }
        QuantFormat::Q4K => {
            let q8_0: Vec<&str> =
                quantized.iter().filter(|(_, m)| matches!(m, QuantMatrix::Q8_0(_))).map(|(n, _)| n.as_str()).collect();
            serde_json::json!({
                "quant_method": StoredQuantization::KYLIN_METHOD,
                "format": StoredQuantization::Q4_K_FORMAT,
                "version": StoredQuantization::Q4_K_VERSION,
                "weights": {"num_bits": 4, "type": "int", "symmetric": false, "strategy": "group", "group_size": 32, "super_block": 256, "scale_bits": 6},
                "rows_per_group": 16,
                "input_activations": {"num_bits": 8, "type": "int", "symmetric": true, "strategy": "group", "group_size": 256, "dynamic": true},
                "quantized_modules": "every linear layer of the decoder and lm_head; embed_tokens as stored",
                "q8_0_modules": q8_0,
            })
        }
    };
    obj.insert("quantization_config".into(), quantization_config);
    obj.insert("tie_word_embeddings".into(), serde_json::Value::Bool(false));
    let config_out = args.out_dir.join("config.json");
    write_new(&config_out, serde_json::to_string_pretty(&config)?.as_bytes())?;
    // The tokenizer and generation files, as `kylin convert` copies them.
    let copied = kylin_loader::llama2c::export::copy_side_files(&source_dir, &args.out_dir, &[])?.copied;
    // The safetensors crate's file is private to the user; give it config.json's permissions.
    if let Ok(meta) = std::fs::metadata(&config_out) {
        let _ = std::fs::set_permissions(&partial, meta.permissions());
    }
    std::fs::rename(&partial, &weights_path).map_err(|e| KylinError::io(&weights_path, "cannot write", &e))?;
    let bytes = std::fs::metadata(&weights_path).map(|m| m.len()).unwrap_or(0);
    println!(
        "wrote {} ({} matrices in {}, {:.1} MB) with {} in {:.1} s",
        args.out_dir.display(),
        quantized.len(),
        format.name(),
        bytes as f64 / 1e6,
        if copied.is_empty() { "no tokenizer files".to_string() } else { copied.join(", ") },
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Creates `dir` (and its parents) unless it already holds a model, which is never overwritten.
fn prepare_out_dir(dir: &Path) -> Result<()> {
    for existing in ["config.json", "model.safetensors", "model.safetensors.index.json"] {
        let path: PathBuf = dir.join(existing);
        if path.exists() {
            return Err(KylinError::input_invalid(format!(
                "{} already holds a model ({existing}); choose an empty or new directory",
                dir.display()
            ))
            .into());
        }
    }
    std::fs::create_dir_all(dir).map_err(|e| KylinError::io(dir, "cannot create", &e))?;
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file renamed into place.
fn write_new(path: &Path, bytes: &[u8]) -> Result<()> {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, bytes).map_err(|e| KylinError::io(&partial, "cannot write", &e))?;
    std::fs::rename(&partial, path).map_err(|e| KylinError::io(path, "cannot write", &e))?;
    Ok(())
}
