//! `generation_config.json` as typed sampling defaults.

use serde::Serialize;

/// Sampling defaults published with the model; `None` means the file did not say.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct GenerationDefaults {
    pub do_sample: Option<bool>,
    pub temperature: Option<f32>,
    pub top_k: Option<usize>,
    pub top_p: Option<f32>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    /// `eos_token_id` (int or list).
    pub eos_token_ids: Vec<u32>,
}

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{KylinError, Result};

fn invalid(path: &Path, key: &str, expected: &str, got: &Value) -> KylinError {
    KylinError::config_invalid(format!(
        "generation_config.json field '{key}' must be {expected}, got {got}; fix or delete the field in {}",
        path.display()
    ))
    .at(path)
}

impl GenerationDefaults {
    /// Reads `generation_config.json`; an absent file gives the defaults (every field `None`).
    pub fn load(path: &Path) -> Result<GenerationDefaults> {
        if !crate::error::regular_file(path)? {
            return Ok(GenerationDefaults::default());
        }
        let text = std::fs::read_to_string(path).map_err(|e| KylinError::io(path, "cannot read", &e))?;
        Self::parse(&text, path)
    }

    /// Parses `generation_config.json` text; `path` is only used in messages.
    pub fn parse(text: &str, path: &Path) -> Result<GenerationDefaults> {
        let obj: Map<String, Value> = match serde_json::from_str(text) {
            Ok(Value::Object(m)) => m,
            Ok(_) => {
                return Err(KylinError::config_invalid(format!("{} must be a JSON object", path.display())).at(path));
            }
            Err(e) => {
                return Err(KylinError::config_invalid(format!("{} is not valid JSON: {e}", path.display())).at(path));
            }
        };
        let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
        let float = |k: &str| -> Result<Option<f32>> {
            get(k).map(|v| v.as_f64().map(|f| f as f32).ok_or_else(|| invalid(path, k, "a number", v))).transpose()
        };
        let uint = |k: &str| -> Result<Option<usize>> {
            get(k)
                .map(|v| v.as_u64().map(|n| n as usize).ok_or_else(|| invalid(path, k, "a non-negative integer", v)))
                .transpose()
        };
        let id = |k: &str, v: &Value| -> Result<u32> {
            v.as_u64().and_then(|n| u32::try_from(n).ok()).ok_or_else(|| invalid(path, k, "a token id", v))
        };
        let eos_token_ids = match get("eos_token_id") {
            None => Vec::new(),
            Some(Value::Array(items)) => items.iter().map(|v| id("eos_token_id", v)).collect::<Result<_>>()?,
            Some(v) => vec![id("eos_token_id", v)?],
        };
        Ok(GenerationDefaults {
            do_sample: get("do_sample")
                .map(|v| v.as_bool().ok_or_else(|| invalid(path, "do_sample", "true or false", v)))
                .transpose()?,
            temperature: float("temperature")?,
            top_k: uint("top_k")?,
            top_p: float("top_p")?,
            min_p: float("min_p")?,
            repetition_penalty: float("repetition_penalty")?,
            max_new_tokens: uint("max_new_tokens")?,
            bos_token_id: get("bos_token_id").map(|v| id("bos_token_id", v)).transpose()?,
            pad_token_id: get("pad_token_id").map(|v| id("pad_token_id", v)).transpose()?,
            eos_token_ids,
        })
    }
}
