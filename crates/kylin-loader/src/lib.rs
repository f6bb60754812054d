//! Kylin's loader: turns a path into a validated, zero-copy model description.
//!
//! Everything that comes from a file is checked here, once, and turned into typed values:
//! [`ModelConfig`] (every value decided), [`ModelWeights`] (views into read-only memory maps,
//! in their stored dtype, every shape checked), [`TokenizerBundle`] and [`GenerationDefaults`].
//! Code downstream trusts these values and never re-checks them. Every failure is a
//! [`KylinError`] with a stable code.

pub mod config;
pub mod error;
pub mod generation;
pub mod tensor;
pub mod tokenizer;
pub mod weights;

pub use config::{Architecture, ModelConfig, RopeConfig, RopeScaling};
pub use error::{ErrorCode, KylinError, Result};
pub use generation::GenerationDefaults;
pub use tensor::{DType, Storage, WeightTensor};
pub use tokenizer::{ChatTemplate, SpecialToken, TokenizerBundle, TokenizerKind};
pub use weights::{HeadBinding, LayerWeights, ModelWeights};
