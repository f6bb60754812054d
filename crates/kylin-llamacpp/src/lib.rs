//! The llama.cpp backend: GGUF files run through llama.cpp behind [`kylin_engine::Backend`].
