//! Opening a model: the format decides the backend, `--backend` can force it.

use std::time::Instant;

use anyhow::Result;
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::{Backend, SerialEngine, Serving};
use kylin_loader::{Format, KylinError, LoadOptions};

use crate::args::{BackendChoice, ModelArgs};

/// A ready backend and what it cost to get there.
pub struct Opened {
    pub backend: Box<dyn Backend>,
    /// Wall time from the path to a ready backend (weights and tokenizer).
    pub load_ms: f64,
    /// The part of `load_ms` spent on the tokenizer, where the backend reports it separately.
    pub tokenizer_ms: Option<f64>,
}

/// The thread count: `--threads`, else the machine's physical cores.
pub fn threads(args: &ModelArgs) -> Result<usize> {
    match args.threads {
        Some(0) => Err(KylinError::input_invalid("--threads must be at least 1").into()),
        Some(n) => Ok(n),
        None => Ok(kylin_kernels::physical_cores()),
    }
}

fn read_chat_template(args: &ModelArgs) -> Result<Option<String>> {
    match &args.chat_template {
        None => Ok(None),
        Some(path) => std::fs::read_to_string(path)
            .map(Some)
            .map_err(|e| KylinError::io(path, "cannot read the --chat-template file", &e).into()),
    }
}

/// Detects the format and opens the model with the matching backend.
pub fn open(args: &ModelArgs, require_tokenizer: bool) -> Result<Opened> {
    let started = Instant::now();
    let format = kylin_loader::detect(&args.model)?;
    let threads = threads(args)?;
    let chat_template_override = read_chat_template(args)?;
    let use_llama = match (args.backend, &format) {
        (BackendChoice::Auto, Format::Gguf { .. }) => true,
        (BackendChoice::Auto, _) => false,
        (BackendChoice::LlamaCpp, Format::Gguf { .. }) => true,
        (BackendChoice::LlamaCpp, _) => {
            return Err(KylinError::operator_unsupported(format!(
                "--backend llama.cpp runs GGUF files, but {} is a {} model; use --backend native \
                 or convert it to GGUF",
                args.model.display(),
                format.name()
            ))
            .into());
        }
        (BackendChoice::Native, Format::Gguf { .. }) => {
            return Err(KylinError::operator_unsupported(format!(
                "the native engine runs Hugging Face safetensors models, but {} is a GGUF file; \
                 use --backend llama.cpp (the default for .gguf)",
                args.model.display()
            ))
            .into());
        }
        (BackendChoice::Native, _) => false,
    };
    if use_llama {
        return open_llama(args, threads, chat_template_override, started);
    }
    let opts = LoadOptions {
        tensor_map: args.tensor_map.clone(),
        allow_vocab_mismatch: args.allow_vocab_mismatch,
        require_tokenizer,
        prefetch: true,
    };
    let model = kylin_loader::load(&args.model, &opts)?;
    for warning in &model.warnings {
        tracing_warning(warning);
    }
    let tokenizer_ms = model.timings.tokenizer_ms;
    let backend =
        NativeBackend::new(model, NativeOptions { threads, ctx_size: args.ctx_size, chat_template_override })?;
    Ok(Opened {
        backend: Box::new(backend),
        load_ms: started.elapsed().as_secs_f64() * 1e3,
        tokenizer_ms: Some(tokenizer_ms),
    })
}

/// The serving engine for `kylin serve` (and anything else that serves requests): the one place
/// that chooses it. Today every model is served one sequence at a time by [`SerialEngine`]
/// (native models through `NativeBackend`, GGUF files through llama.cpp); the continuous-batching
/// engine replaces the native case here, sized by `args.engine`.
///
/// Called on the thread that will drive the engine (llama.cpp's context is not `Send`).
pub fn open_engine(args: &ModelArgs) -> Result<Box<dyn Serving>> {
    let opened = open(args, false)?;
    Ok(Box::new(SerialEngine::new(opened.backend)))
}

/// Loader warnings go to stderr, once, prefixed so scripts can filter them.
fn tracing_warning(warning: &str) {
    if std::env::var_os("KYLIN_QUIET").is_none() {
        eprintln!("warning: {warning}");
    }
}

#[cfg(feature = "llamacpp")]
fn open_llama(
    args: &ModelArgs,
    threads: usize,
    chat_template_override: Option<String>,
    started: Instant,
) -> Result<Opened> {
    use kylin_llamacpp::{LlamaCppBackend, LlamaCppOptions};
    let backend = LlamaCppBackend::load(
        &args.model,
        &LlamaCppOptions { threads, ctx_size: args.ctx_size, chat_template_override },
    )?;
    Ok(Opened { backend: Box::new(backend), load_ms: started.elapsed().as_secs_f64() * 1e3, tokenizer_ms: None })
}

#[cfg(not(feature = "llamacpp"))]
fn open_llama(
    args: &ModelArgs,
    _threads: usize,
    _chat_template_override: Option<String>,
    _started: Instant,
) -> Result<Opened> {
    Err(KylinError::operator_unsupported(format!(
        "{} is a GGUF file, which runs through llama.cpp, but this kylin was built without the \
         `llamacpp` feature; rebuild with default features",
        args.model.display()
    ))
    .into())
}
