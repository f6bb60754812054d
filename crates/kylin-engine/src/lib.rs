//! Kylin's engine: the native forward pass over bound weights, the KV cache, sampling, the
//! tokenizer and chat template, and the generation loop, all behind the [`Backend`] interface
//! that llama.cpp also implements.

pub mod backend;
pub mod batch;
pub mod detok;
pub mod draft;
pub mod encoder;
pub mod encoder_serving;
pub mod generate;
pub mod grammar;
pub mod kv_pool;
pub mod model;
pub mod mtp;
pub mod native;
pub mod retrieval;
pub mod rope;
pub mod sampler;
pub mod sequence;
pub mod serial;
pub mod serving;
mod shared_mut;
pub mod speculative;
pub mod state_pool;
pub mod text;
pub mod tools;
pub mod vision;

pub use backend::{Backend, BackendSummary, ChatMessage};
pub use generate::{ChatSession, FinishReason, GenerateRequest, GenerationResult, GenerationTimings, generate};
pub use model::{PrecisionChoice, QuantFormat};
pub use sampler::{Sampler, SamplingParams};
pub use serial::SerialEngine;
pub use serving::{
    CancelHandle, EmbeddingInfo, EngineInfo, EngineStats, Event, EventKind, Request, Serving, StatePoolInfo,
    StopReason, Usage,
};
pub use text::TextCodec;
