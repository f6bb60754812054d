//! Kylin's engine: the native forward pass over bound weights, the KV cache, sampling, the
//! tokenizer and chat template, and the generation loop, all behind the [`Backend`] interface
//! that llama.cpp also implements.

pub mod backend;

pub use backend::{Backend, BackendSummary, ChatMessage};
