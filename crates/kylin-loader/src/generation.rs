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
