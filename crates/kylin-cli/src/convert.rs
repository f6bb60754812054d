//! `kylin convert`: a Llama Hugging Face directory (or a `.bin`) to a llama2.c `.bin` of version
//! 0, 1 or 2, and a `.bin` back to a Hugging Face directory.
//!
//! The input is loaded with the usual validation (`kylin_loader::load`), so anything that
//! converts also runs; the formats are written by `kylin_loader::llama2c::export`. The tokenizer
//! and generation files beside the input are copied beside the output (never over a different
//! file of the same name), and a `.bin`'s `tokenizer.bin` becomes `tokenizer.json` in a Hugging
//! Face directory.

use std::path::Path;
use std::time::Instant;

use anyhow::Result;
use kylin_loader::llama2c::{
    self,
    export::{self, Copied},
};
use kylin_loader::{Format, KylinError, LoadOptions, LoadedModel};
use serde_json::json;

use crate::args::{ConvertArgs, ConvertTarget};

pub fn run(args: ConvertArgs) -> Result<()> {
    let started = Instant::now();
    let opts = LoadOptions { prefetch: true, ..LoadOptions::default() };
    crate::sigbus::watch(&args.model);
    let model = kylin_loader::load(&args.model, &opts)?;
    let mut warnings = model.warnings.clone();
    let source_dir = model.format.dir().map(Path::to_path_buf);

    let (format, version, files, copied) = match args.to {
        ConvertTarget::Hf => {
            if !matches!(model.format, Format::LegacyBin { .. }) {
                return Err(KylinError::input_invalid(format!(
                    "--to hf converts a llama2.c .bin; {} is already a {} model",
                    args.model.display(),
                    model.format.name()
                ))
                .into());
            }
            check_out_dir(&args.out, args.force)?;
            let written = export::write_hf(&model, &args.out)?;
            // The tokenizer.bin was rewritten as tokenizer.json; the rest is copied as it is.
            let copied = copy_beside(&model, source_dir.as_deref(), &args.out, &written, &mut warnings)?;
            ("hf-dir", None, written, copied)
        }
        target => {
            let version = match target {
                ConvertTarget::BinV0 => 0,
                ConvertTarget::BinV1 => 1,
                _ => 2,
            };
            check_out_file(&args.out, args.force)?;
            let header = export::write_bin(&model, version, &args.out)?;
            if header.rope_theta.is_some() {
                let c = &model.config;
                let mut differ = Vec::new();
                if c.rope.theta != llama2c::ROPE_THETA {
                    differ.push(format!("rope_theta {} (llama2.c: {})", c.rope.theta, llama2c::ROPE_THETA));
                }
                if c.rms_norm_eps != llama2c::RMS_NORM_EPS {
                    differ.push(format!("rms_norm_eps {} (llama2.c: {})", c.rms_norm_eps, llama2c::RMS_NORM_EPS));
                }
                warnings.push(format!(
                    "{} kept in Kylin's header extension: Kylin reads it, llama2.c's run.c would use its fixed value",
                    differ.join(" and ")
                ));
            }
            let out_dir = kylin_loader::parent_dir(&args.out);
            let copied = copy_beside(&model, source_dir.as_deref(), out_dir, &[], &mut warnings)?;
            let name = args.out.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
            ("llama2c-bin", Some(version), vec![name], copied)
        }
    };

    let bytes =
        std::fs::metadata(&args.out).map(|m| if m.is_dir() { dir_bytes(&args.out) } else { m.len() }).unwrap_or(0);
    let seconds = started.elapsed().as_secs_f64();
    if args.json {
        let obj = json!({
            "out": args.out,
            "format": format,
            "version": version,
            "files": files,
            "copied": copied.copied,
            "bytes": bytes,
            "seconds": seconds,
            "warnings": warnings,
        });
        println!("{obj}");
    } else {
        let what = match version {
            Some(0) => "llama2.c version 0 (float32)".to_string(),
            Some(1) => "llama2.c version 1 (float32)".to_string(),
            Some(v) => format!("llama2.c version {v} (Q8_0)"),
            None => "Hugging Face directory (float32 safetensors)".to_string(),
        };
        println!(
            "kylin convert: wrote {} as a {what}: {} file(s), {:.1} MiB in {seconds:.2} s",
            args.out.display(),
            files.len() + copied.copied.len(),
            bytes as f64 / (1u64 << 20) as f64
        );
        let mut all = files.clone();
        all.extend(copied.copied.iter().cloned());
        println!("  {}", all.join(", "));
        for w in &warnings {
            eprintln!("warning: {w}");
        }
    }
    Ok(())
}

/// Copies the tokenizer and generation files beside the input to `out_dir`, except `written`
/// (and `tokenizer.bin` for a Hugging Face output, which reads `tokenizer.json` instead).
fn copy_beside(
    model: &LoadedModel,
    source_dir: Option<&Path>,
    out_dir: &Path,
    written: &[String],
    warnings: &mut Vec<String>,
) -> Result<Copied> {
    let Some(source_dir) = source_dir else { return Ok(Copied::default()) };
    let mut skip = written.to_vec();
    let to_hf = !written.is_empty();
    if to_hf {
        skip.push("tokenizer.bin".into());
    }
    let copied = export::copy_side_files(source_dir, out_dir, &skip)?;
    warnings.extend(copied.warnings.iter().cloned());
    let has_tokenizer_bin = out_dir.join("tokenizer.bin").is_file();
    let tokenizer_from_json =
        model.tokenizer.as_ref().is_some_and(|t| t.kind != kylin_loader::TokenizerKind::Llama2cBin);
    if !to_hf && has_tokenizer_bin && tokenizer_from_json {
        warnings.push(format!(
            "{} holds a tokenizer.bin, which Kylin reads before tokenizer.json: the converted model will use it; \
             write the .bin into its own directory to keep the model's tokenizer",
            out_dir.display()
        ));
    }
    Ok(copied)
}

fn check_out_file(out: &Path, force: bool) -> Result<()> {
    if out.extension().and_then(|e| e.to_str()) != Some("bin") {
        return Err(KylinError::input_invalid(format!(
            "{} should end in .bin: Kylin recognises llama2.c checkpoints (version 0 has no magic) by that extension",
            out.display()
        ))
        .into());
    }
    if out.is_dir() {
        return Err(KylinError::input_invalid(format!(
            "{} is a directory; give the .bin file to write",
            out.display()
        ))
        .into());
    }
    if out.exists() && !force {
        return Err(KylinError::input_invalid(format!("{} exists; pass --force to replace it", out.display())).into());
    }
    let dir = kylin_loader::parent_dir(out);
    if !dir.is_dir() {
        return Err(KylinError::file_not_found(format!(
            "{} does not exist; create the directory first",
            dir.display()
        ))
        .into());
    }
    Ok(())
}

fn check_out_dir(out: &Path, force: bool) -> Result<()> {
    if out.is_file() {
        return Err(
            KylinError::input_invalid(format!("{} is a file; --to hf writes a directory", out.display())).into()
        );
    }
    let non_empty = std::fs::read_dir(out).map(|mut d| d.next().is_some()).unwrap_or(false);
    if non_empty && !force {
        return Err(KylinError::input_invalid(format!(
            "{} is not empty; pass --force to write into it",
            out.display()
        ))
        .into());
    }
    Ok(())
}

/// Bytes of the files directly in `dir`.
fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok()?.metadata().ok()).filter(|m| m.is_file()).map(|m| m.len()).sum())
        .unwrap_or(0)
}
