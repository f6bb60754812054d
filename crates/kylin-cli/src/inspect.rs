//! `kylin inspect`: validate a model and describe it, with the kernels that would run it.

use anyhow::Result;
use kylin_kernels::Precision;
use kylin_loader::LoadOptions;
use serde_json::json;

use crate::args::InspectArgs;

pub fn run(args: InspectArgs) -> Result<()> {
    if args.architectures {
        return list_architectures(args.json);
    }
    let Some(model) = args.model else {
        anyhow::bail!("[INPUT_INVALID] kylin inspect needs a MODEL path (or --architectures)");
    };
    let opts = LoadOptions {
        tensor_map: args.tensor_map,
        allow_vocab_mismatch: args.allow_vocab_mismatch,
        require_tokenizer: false,
        prefetch: false,
        ..LoadOptions::default()
    };
    let report = kylin_loader::inspect(&model, &opts)?;
    let kernels = kernels_report(&report);
    if args.json {
        let mut value = serde_json::to_value(&report)?;
        if let Some(obj) = value.as_object_mut() {
            obj.insert("kernels".into(), kernels);
        }
        println!("{}", serde_json::to_string_pretty(&value)?);
    } else {
        print!("{}", report.to_human());
        if report.backend == "kylin" {
            println!(
                "kernels: f32 {}, bf16 {}, q8_0 {}, q4_k {}; --precision auto runs {}",
                kernels["f32"].as_str().unwrap_or("?"),
                kernels["bf16"].as_str().unwrap_or("none (this CPU has no BF16 matrix kernels)"),
                kernels["q8_0"].as_str().unwrap_or("?"),
                kernels["q4_k"].as_str().unwrap_or("?"),
                kernels["auto_precision"].as_str().unwrap_or("?"),
            );
        }
    }
    Ok(())
}

/// The kernel families of this machine and the precision `--precision auto` picks for this
/// model (the engine's rule: `bf16` when every matrix is BF16 and the CPU has BF16 kernels;
/// llama.cpp: `null`).
fn kernels_report(report: &kylin_loader::InspectReport) -> serde_json::Value {
    let bf16 = kylin_kernels::bf16_kernels().map(|k| k.name());
    let auto = report.binding.as_ref().map(|b| {
        let all_bf16 = b.matrix_dtypes.keys().all(|d| d == "BF16");
        if bf16.is_some() && all_bf16 { "bf16" } else { "f32" }
    });
    json!({
        "f32": kylin_kernels::kernel_family(Precision::F32),
        "bf16": bf16,
        "q8_0": kylin_kernels::quant::q8_kernels(),
        // Q4_K runs on the same int8 dot-product family as Q8_0, its prefill on AMX-INT8 tiles
        // where the CPU has them.
        "q4_k": kylin_kernels::quant::q4k_kernels(),
        "auto_precision": auto,
    })
}

/// `kylin inspect --architectures`: every registered family, one line each (or JSON).
fn list_architectures(json: bool) -> Result<()> {
    let families = kylin_loader::family::REGISTRY;
    if json {
        let list: Vec<serde_json::Value> = families
            .iter()
            .map(|f| json!({"architecture": f.hf_name, "model_type": f.model_type, "about": f.about}))
            .collect();
        println!("{}", serde_json::to_string_pretty(&json!({ "architectures": list }))?);
    } else {
        println!("architectures the native engine runs ({}):", families.len());
        for f in families {
            println!("  {:<24} {:<12} {}", f.hf_name, f.model_type, f.about);
        }
        println!("GGUF files of any architecture llama.cpp knows run through llama.cpp.");
    }
    Ok(())
}
