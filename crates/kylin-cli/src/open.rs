//! Opening a model: the format decides the backend, `--backend` can force it.

use std::time::Instant;

use anyhow::Result;
use kylin_engine::batch::{DEFAULT_MAX_BATCH_TOKENS, DEFAULT_MAX_SEQS, EngineOptions, KvBudget, QuantizeProgress};
use kylin_engine::native::{NativeBackend, NativeOptions};
use kylin_engine::{Backend, PrecisionChoice, Serving};
use kylin_kernels::WeightDType;
use kylin_loader::{Format, KylinError, LoadOptions};

use crate::args::{BackendChoice, FlashAttnArg, KvDTypeArg, ModelArgs, PrecisionArg, QuantizeArg};

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

/// Whether `args` names a model that runs on llama.cpp (a GGUF file, unless `--backend native`
/// refuses it); a file that cannot be read counts as not (opening it reports why).
pub fn runs_on_llama_cpp(args: &ModelArgs) -> bool {
    kylin_loader::detect(&args.model).is_ok_and(|format| matches!(uses_llama_cpp(args, &format), Ok(true)))
}

/// Whether `--backend` runs a model of `format` on llama.cpp (`true`) or on Kylin's own engine
/// (`false`), or why neither can.
fn uses_llama_cpp(args: &ModelArgs, format: &Format) -> Result<bool> {
    match (args.backend, format) {
        (BackendChoice::Auto | BackendChoice::LlamaCpp, Format::Gguf { .. }) => Ok(true),
        (BackendChoice::LlamaCpp, _) => Err(KylinError::operator_unsupported(format!(
            "--backend llama.cpp runs GGUF files, but {} is a {} model; use --backend native \
             or convert it to GGUF",
            args.model.display(),
            format.name()
        ))
        .into()),
        (BackendChoice::Native, Format::Gguf { .. }) => Err(KylinError::operator_unsupported(format!(
            "the native engine runs Hugging Face safetensors models and llama2.c .bin files, but {} is a GGUF file; \
             use --backend llama.cpp (the default for .gguf)",
            args.model.display()
        ))
        .into()),
        (BackendChoice::Auto | BackendChoice::Native, _) => Ok(false),
    }
}

/// `--flash-attn on|off` on a model that runs on Kylin's own engine is `CONFIG_INVALID`.
pub fn refuse_flash_attn(args: &ModelArgs) -> Result<()> {
    if args.flash_attn == FlashAttnArg::Auto {
        return Ok(());
    }
    Err(KylinError::config_invalid(format!(
        "--flash-attn {} configures llama.cpp, which runs GGUF files; {} runs on Kylin's own engine, \
         whose paged attention has one arithmetic (omit --flash-attn or pass auto)",
        crate::args::flag_value(&args.flash_attn),
        args.model.display()
    ))
    .into())
}

/// The llama.cpp attention choice of a `--flash-attn` flag.
#[cfg(feature = "llamacpp")]
pub fn flash_attention(flag: FlashAttnArg) -> kylin_llamacpp::FlashAttention {
    match flag {
        FlashAttnArg::Auto => kylin_llamacpp::FlashAttention::Auto,
        FlashAttnArg::On => kylin_llamacpp::FlashAttention::On,
        FlashAttnArg::Off => kylin_llamacpp::FlashAttention::Off,
    }
}

/// Detects the format and opens the model with the matching backend.
pub fn open(args: &ModelArgs, require_tokenizer: bool) -> Result<Opened> {
    open_with(args, require_tokenizer, false)
}

/// [`open`], and with `prefault` the native engine touches its KV pool and activation buffers
/// at start-up, as the server's does (`bench` measures what a server's request sees, not the
/// page faults of a process's first prompt; llama.cpp clears its KV cache when it makes it).
pub fn open_with(args: &ModelArgs, require_tokenizer: bool, prefault: bool) -> Result<Opened> {
    let started = Instant::now();
    crate::sigbus::watch(&args.model);
    let format = kylin_loader::detect(&args.model)?;
    let threads = threads(args)?;
    let chat_template_override = read_chat_template(args)?;
    let use_llama = uses_llama_cpp(args, &format)?;
    if use_llama {
        if let Some(p @ (PrecisionArg::F32 | PrecisionArg::Bf16 | PrecisionArg::Int8)) = args.engine.precision {
            return Err(KylinError::config_invalid(format!(
                "--precision {} applies to the native engine; llama.cpp computes {} in the types \
                 of its GGUF weights (omit --precision or pass auto)",
                crate::args::flag_value(&p),
                args.model.display()
            ))
            .into());
        }
        if let Some(q) = args.engine.quantize {
            return Err(KylinError::config_invalid(format!(
                "--quantize {} applies to the native engine; {} runs through llama.cpp in the types of its GGUF \
                 weights (pick a GGUF file of the type you want, or quantize the Hugging Face directory)",
                crate::args::flag_value(&q),
                args.model.display()
            ))
            .into());
        }
        return open_llama(args, threads, chat_template_override, started);
    }
    refuse_flash_attn(args)?;
    let opts = LoadOptions {
        tensor_map: args.tensor_map.clone(),
        allow_vocab_mismatch: args.allow_vocab_mismatch,
        require_tokenizer,
        prefetch: true,
        task: args.task.into(),
        mtp: false,
    };
    let model = kylin_loader::load(&args.model, &opts)?;
    for warning in &model.warnings {
        tracing_warning(warning);
    }
    let tokenizer_ms = model.timings.tokenizer_ms;
    // One sequence decodes one token at a time here: speculation is the batching engine's.
    let engine = EngineOptions {
        speculative_tokens: 0,
        draft_model: None,
        mtp: false,
        prefault,
        ..engine_options(args, threads, 1)?
    };
    if args.engine.speculative_tokens.is_some_and(|k| k > 0) || args.engine.draft_model.is_some() || args.engine.mtp {
        tracing_warning(
            "--speculative-tokens, --draft-model and --mtp apply to the batching engine (serve, bench --concurrency); \
             ignored here",
        );
    }
    let backend = NativeBackend::new(
        model,
        NativeOptions { threads, ctx_size: args.ctx_size, chat_template_override, engine: Some(engine) },
    )?;
    Ok(Opened {
        backend: Box::new(backend),
        load_ms: started.elapsed().as_secs_f64() * 1e3,
        tokenizer_ms: Some(tokenizer_ms),
    })
}

/// Opens a model as a request-level engine for `serve`: the continuous-batching engine for
/// Hugging Face models, llama.cpp one sequence at a time for GGUF files. Called on the thread
/// that will drive the engine (llama.cpp's context must stay on one thread).
pub fn open_engine(args: &ModelArgs) -> Result<Box<dyn Serving>> {
    // A server holds its memory from the start: the footprint does not grow with traffic.
    open_engine_sized(args, DEFAULT_MAX_SEQS, true)
}

/// [`open_engine`] with the batching engine's default `--max-seqs` and whether it prefaults its
/// memory (`kylin embed` sizes it to its batch and touches memory as it goes).
pub fn open_engine_sized(args: &ModelArgs, default_max_seqs: usize, prefault: bool) -> Result<Box<dyn Serving>> {
    crate::sigbus::watch(&args.model);
    let format = kylin_loader::detect(&args.model)?;
    let gguf = matches!(format, Format::Gguf { .. });
    if gguf || args.backend == BackendChoice::LlamaCpp {
        let opened = open(args, false)?;
        return Ok(Box::new(kylin_engine::SerialEngine::new(opened.backend)));
    }
    refuse_flash_attn(args)?;
    let threads = threads(args)?;
    if kylin_loader::encoder::is_encoder_dir(&args.model) {
        return Ok(Box::new(open_encoder(args, threads)?));
    }
    let opts = LoadOptions {
        tensor_map: args.tensor_map.clone(),
        allow_vocab_mismatch: args.allow_vocab_mismatch,
        require_tokenizer: false,
        prefetch: true,
        task: args.task.into(),
        mtp: args.engine.mtp,
    };
    let model = kylin_loader::load(&args.model, &opts)?;
    for warning in &model.warnings {
        tracing_warning(warning);
    }
    let engine = EngineOptions { prefault, ..engine_options(args, threads, default_max_seqs)? };
    let batch = kylin_engine::batch::BatchEngine::new(model, &engine)?;
    if let Some(draft) = batch.draft()
        && std::env::var_os("KYLIN_QUIET").is_none()
    {
        eprintln!(
            "draft model {}: {:.1}M parameters, {} tokens proposed per sequence and step, KV pool {}",
            draft.path().display(),
            draft.model().parameter_count() as f64 / 1e6,
            engine.speculative_tokens,
            kylin_engine::batch::human_bytes(draft.kv_bytes())
        );
    }
    if let Some(mtp) = batch.mtp()
        && std::env::var_os("KYLIN_QUIET").is_none()
    {
        eprintln!(
            "MTP head: {} tokens proposed per sequence and step, KV pool {}",
            engine.speculative_tokens,
            kylin_engine::batch::human_bytes(mtp.kv_bytes())
        );
    }
    Ok(Box::new(batch))
}

/// Opens an encoder directory (BERT, XLM-R: embeddings or a cross-encoder) as its engine.
pub fn open_encoder(args: &ModelArgs, threads: usize) -> Result<kylin_engine::encoder_serving::EncoderEngine> {
    let loaded = kylin_loader::encoder::load_encoder(&args.model)?;
    for warning in &loaded.warnings {
        tracing_warning(warning);
    }
    let max_batch_tokens =
        args.engine.max_batch_tokens.unwrap_or(kylin_engine::encoder::EncoderOptions::default().max_batch_tokens);
    Ok(kylin_engine::encoder_serving::EncoderEngine::new(
        loaded,
        kylin_engine::encoder::EncoderOptions { threads, max_batch_tokens },
    )?)
}

/// Parses a memory size: a number of bytes with an optional unit (`B`, `KiB`, `MiB`, `GiB`,
/// `TiB`, or the decimal `KB`, `MB`, `GB`, `TB`; case-insensitive), e.g. `2GiB` or `1.5GB`.
pub fn parse_size(text: &str) -> Result<u64> {
    parse_size_of("--kv-memory", text)
}

/// [`parse_size`] for the flag `flag` (named in the error).
pub fn parse_size_of(flag: &str, text: &str) -> Result<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || {
        KylinError::input_invalid(format!(
            "{flag} '{text}' is not a size; expected a number with a unit such as 2GiB, 512MiB or 1.5GB"
        ))
    };
    let value: f64 = number.parse().map_err(|_| bad())?;
    let scale: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024.0 * 1024.0,
        "g" | "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tib" => 1024.0f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return Err(bad().into()),
    };
    let bytes = value * scale;
    if !(bytes.is_finite() && bytes >= 1.0 && bytes < u64::MAX as f64) {
        return Err(bad().into());
    }
    Ok(bytes as u64)
}

/// The engine's sizing from the flags; `default_max_seqs` applies when `--max-seqs` is absent.
pub fn engine_options(args: &ModelArgs, threads: usize, default_max_seqs: usize) -> Result<EngineOptions> {
    let e = &args.engine;
    let kv_budget = match (&e.kv_memory, e.memory_fraction) {
        (Some(size), _) => KvBudget::Bytes(parse_size(size)?),
        (None, Some(f)) => KvBudget::Fraction(f),
        (None, None) => KvBudget::Default,
    };
    let kv_dtype = e.kv_dtype.map(|d| match d {
        KvDTypeArg::F32 => WeightDType::F32,
        KvDTypeArg::F16 => WeightDType::F16,
        KvDTypeArg::Bf16 => WeightDType::BF16,
    });
    Ok(EngineOptions {
        threads,
        ctx_size: args.ctx_size,
        kv_budget,
        kv_dtype,
        max_seqs: e.max_seqs.unwrap_or(default_max_seqs.max(1)),
        max_batch_tokens: e.max_batch_tokens.unwrap_or(DEFAULT_MAX_BATCH_TOKENS),
        block_size: e.kv_block_size,
        chat_template_override: read_chat_template(args)?,
        prefault: false,
        precision: match e.precision.unwrap_or(PrecisionArg::Auto) {
            PrecisionArg::F32 => PrecisionChoice::F32,
            PrecisionArg::Bf16 => PrecisionChoice::Bf16,
            PrecisionArg::Auto => PrecisionChoice::Auto,
            PrecisionArg::Int8 => PrecisionChoice::Int8,
        },
        quantize: e.quantize.map(QuantizeArg::format),
        quantize_progress: e.quantize.map(|_| quantize_progress_bar()),
        state_snapshots: e.state_snapshots,
        // A draft model or an MTP head without a count proposes its default number of tokens.
        speculative_tokens: e.speculative_tokens.unwrap_or(if e.draft_model.is_some() {
            kylin_engine::draft::DEFAULT_DRAFT_TOKENS
        } else if e.mtp {
            kylin_engine::mtp::DEFAULT_MTP_TOKENS
        } else {
            0
        }),
        speculative_step_tokens: e
            .speculative_step_tokens
            .unwrap_or(kylin_engine::batch::DEFAULT_SPECULATIVE_STEP_TOKENS),
        draft_model: e.draft_model.clone(),
        draft_kv_tokens: None,
        mtp: e.mtp,
    })
}

/// A progress bar on stderr for the quantization at load (hidden when stderr is not a
/// terminal, as indicatif does), finished when the last byte is done.
pub(crate) fn quantize_progress_bar() -> QuantizeProgress {
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template("quantizing {bar:40} {binary_bytes}/{binary_total_bytes} {elapsed}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    QuantizeProgress(std::sync::Arc::new(move |done, total| {
        bar.set_length(total);
        bar.set_position(done);
        if done >= total {
            bar.finish_and_clear();
        }
    }))
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
        &LlamaCppOptions {
            threads,
            ctx_size: args.ctx_size,
            chat_template_override,
            flash_attention: flash_attention(args.flash_attn),
        },
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
