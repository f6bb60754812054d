//! `config.json` in both layouts, parsed faithfully, then resolved into a [`ModelConfig`] where
//! every value is decided.
//!
//! Published checkpoints put `rope_theta`, `rope_scaling` and `torch_dtype` at the top level;
//! transformers 5 writes `rope_parameters` and `dtype`. Both resolve to the same `ModelConfig`.

use serde::Serialize;

/// The architectures Kylin's native engine knows, from `architectures[0]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum Architecture {
    Qwen3,
    Qwen2,
    Llama,
    Mistral,
}

impl Architecture {
    /// Every supported `architectures[0]` value, for error messages.
    pub const SUPPORTED: [&'static str; 4] =
        ["Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM"];

    /// The Hugging Face class name, e.g. `Qwen3ForCausalLM`.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
        }
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
}

/// Rotary embedding settings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RopeConfig {
    pub theta: f64,
    /// Fraction of `head_dim` that is rotated (1.0 for every supported architecture).
    pub partial_rotary_factor: f64,
    pub scaling: RopeScaling,
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
    /// Per-head RMSNorm on q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The activation, `silu` for every supported architecture.
    pub hidden_act: String,
    /// `dtype` / `torch_dtype` as declared, if any.
    pub declared_dtype: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// Fields that were absent and took their default, by config.json name.
    pub defaulted: Vec<String>,
}
