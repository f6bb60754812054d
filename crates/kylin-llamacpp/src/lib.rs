//! The llama.cpp backend: GGUF files run through llama.cpp behind [`kylin_engine::Backend`].
//!
//! [`LlamaCppBackend::load`] validates the file with Kylin's own GGUF reader first (so a
//! truncated or foreign file is a `FILE_CORRUPTED` error naming the path, never a crash inside
//! C++), then loads it with llama.cpp (CPU only, memory-mapped) and creates one context whose
//! KV cache, batch and logits buffer are all sized at load time.
//!
//! Guarantees:
//! - llama.cpp is initialised once per process ([`LlamaBackend::init`] refuses a second call),
//!   however many models are loaded; its own logging is silenced unless `KYLIN_LLAMA_LOG=1`.
//! - Every llama.cpp failure (model load, context creation, decode, tokenizer, chat template) is
//!   a [`KylinError`], `BACKEND_FAILED` unless a more precise code applies, naming the path.
//! - Every id handed to llama.cpp is checked against the vocabulary first: llama.cpp throws a C++
//!   exception (which aborts the process) on an out-of-range id in some functions.
//! - A decode step allocates nothing on the Rust side: the batch and the logits buffer are reused.
//!
//! Chat templates: the Jinja template embedded in the GGUF (`tokenizer.chat_template`) is
//! rendered by Kylin's own Jinja renderer ([`kylin_engine::TextCodec`]), exactly as
//! `transformers` renders it, `kwargs` (such as `enable_thinking`) included. llama.cpp's built-in
//! engine (`llama_chat_apply_template`) is only the fallback, for a template our renderer cannot
//! compile or for an override that is a llama.cpp template name (`chatml`, `llama3`, ...): it
//! recognises well-known templates by their markers and re-implements them in C++, ignores
//! `kwargs`, and misses template logic such as the default system prompt that Qwen2.5 and
//! SmolLM2 insert when the conversation has none.

pub mod concurrent;
pub mod embed;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use kylin_engine::{Backend, BackendSummary, ChatMessage, TextCodec};
use kylin_loader::{ChatTemplate, ErrorCode, KylinError, Result, SpecialToken, TokenizerBundle, TokenizerKind};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaChatTemplate, LlamaModel};
use llama_cpp_2::token::LlamaToken;

/// The context size used when neither the caller nor the model asks for a smaller one.
const DEFAULT_MAX_CONTEXT: usize = 4096;

/// The largest number of tokens decoded in one `llama_decode` call (llama.cpp's own default
/// micro-batch). Longer prompts are split into chunks of this size. A larger batch would make
/// llama.cpp reserve a compute buffer for `batch x vocab` logits at context creation.
pub(crate) const MAX_BATCH: usize = 512;

/// Texts and conversations longer than this are refused before they reach llama.cpp, whose
/// interfaces count bytes and tokens in `i32`.
const MAX_TEXT_BYTES: usize = (i32::MAX / 4) as usize;

/// How to run a GGUF file.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LlamaCppOptions {
    /// Threads for both prompt processing and decoding; 0 means all available cores.
    pub threads: usize,
    /// KV cache size in tokens; `None` means `min(n_ctx_train, 4096)`.
    pub ctx_size: Option<usize>,
    /// A chat template used instead of the one embedded in the file: Jinja text (anything
    /// containing `{%` or `{{`), else a llama.cpp built-in template name such as `chatml`.
    pub chat_template_override: Option<String>,
    /// llama.cpp's flash attention (its `-fa`): `Auto` lets llama.cpp decide, which on a CPU
    /// turns it on.
    pub flash_attention: FlashAttention,
}

/// llama.cpp's attention kernel choice. The two differ in arithmetic, not only in speed: with
/// flash attention llama.cpp's CPU kernel converts the queries to f16 and accumulates the
/// weighted values in f16; without it, the scores and probabilities go through f16 matrix
/// products with f32 sums. BENCHMARKS.md measures how far apart the two land.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FlashAttention {
    #[default]
    Auto,
    On,
    Off,
}

impl FlashAttention {
    pub(crate) fn policy(self) -> llama_cpp_sys_2::llama_flash_attn_type {
        match self {
            FlashAttention::Auto => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_AUTO,
            FlashAttention::On => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED,
            FlashAttention::Off => llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }
    }
}

/// The process-wide llama.cpp initialisation, or the reason it failed.
static LLAMA: OnceLock<std::result::Result<LlamaBackend, String>> = OnceLock::new();

/// Whether llama.cpp's and ggml's log goes to standard error (`KYLIN_LLAMA_LOG=1`); else
/// [`on_log`] drops it.
static LOG_TO_STDERR: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

thread_local! {
    /// What llama.cpp said of flash attention when it last created a context on this thread:
    /// `Some(true)` enabled, `Some(false)` not supported, `None` nothing (yet).
    static FLASH_ATTENTION_RESOLVED: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
}

/// llama.cpp's and ggml's log callback. It writes the text to standard error when asked to and
/// notes how `-fa auto` was resolved: llama.cpp decides when it creates a context, on the
/// creating thread, and says so in its log ("Flash Attention enabled" or "... not supported,
/// set to disabled"), which is the only place it reports the choice.
///
/// Nothing here may unwind into C: no indexing, no `unwrap`, a failed write is ignored.
unsafe extern "C" fn on_log(
    _level: llama_cpp_sys_2::ggml_log_level,
    text: *const std::ffi::c_char,
    _user_data: *mut std::ffi::c_void,
) {
    if text.is_null() {
        return;
    }
    // SAFETY: llama.cpp passes a NUL-terminated string that lives for the call.
    let bytes = unsafe { std::ffi::CStr::from_ptr(text) }.to_bytes();
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    let resolved = if has(b"Flash Attention enabled") {
        Some(true)
    } else if has(b"Flash Attention not supported") {
        Some(false)
    } else {
        None
    };
    if resolved.is_some() {
        // `try_with` fails only while the thread's locals are torn down; the note is then moot.
        let _ = FLASH_ATTENTION_RESOLVED.try_with(|r| r.set(resolved));
    }
    if LOG_TO_STDERR.load(std::sync::atomic::Ordering::Relaxed) {
        use std::io::Write;
        let _ = std::io::stderr().write_all(bytes);
    }
}

/// Creates a llama.cpp context with `create` and returns it with the attention kernel it runs
/// (the label `kylin bench` prints): `flash` or `standard`, and how that was chosen.
pub(crate) fn with_attention_kernel<T>(
    requested: FlashAttention,
    create: impl FnOnce() -> Result<T>,
) -> Result<(T, String)> {
    let _ = FLASH_ATTENTION_RESOLVED.try_with(|r| r.set(None));
    let context = create()?;
    let resolved = FLASH_ATTENTION_RESOLVED.try_with(|r| r.take()).ok().flatten();
    let label = match (requested, resolved) {
        (FlashAttention::On, _) => "flash (--flash-attn on)",
        (FlashAttention::Off, _) => "standard (--flash-attn off)",
        (FlashAttention::Auto, Some(true)) => "flash (--flash-attn auto)",
        (FlashAttention::Auto, Some(false)) => "standard (--flash-attn auto: flash unsupported)",
        (FlashAttention::Auto, None) => "llama.cpp's choice (--flash-attn auto, not reported)",
    };
    Ok((context, label.to_string()))
}

/// Initialises llama.cpp once per process and returns the proof of initialisation.
pub(crate) fn llama_backend() -> Result<&'static LlamaBackend> {
    let state = LLAMA.get_or_init(|| {
        LOG_TO_STDERR
            .store(std::env::var("KYLIN_LLAMA_LOG").as_deref() == Ok("1"), std::sync::atomic::Ordering::Relaxed);
        // SAFETY: `on_log` has the callback's signature and never unwinds; it is installed
        // once, before llama.cpp does anything else, and sets ggml's callback too.
        unsafe { llama_cpp_sys_2::llama_log_set(Some(on_log), std::ptr::null_mut()) };
        LlamaBackend::init().map_err(|e| e.to_string())
    });
    state.as_ref().map_err(|e| {
        KylinError::backend_failed(format!(
            "llama.cpp could not be initialised: {e}; run with KYLIN_LLAMA_LOG=1 to see its log"
        ))
    })
}

/// A GGUF model loaded into llama.cpp with one sequence and its KV cache.
pub struct LlamaCppBackend {
    // Field order is drop order: the context and the batch must be freed before the model the
    // context points into. `ctx` borrows `model` for real; its `'static` lifetime is a promise
    // kept by this order and by never handing out the context itself.
    ctx: LlamaContext<'static>,
    batch: LlamaBatch<'static>,
    model: Box<LlamaModel>,
    path: PathBuf,
    chat_template: Option<ChatRenderer>,
    /// Logits of the last position computed, `n_vocab` long, allocated once.
    logits: Vec<f32>,
    eos: Vec<u32>,
    n_vocab: usize,
    n_ctx: usize,
    n_batch: usize,
    position: usize,
    threads: usize,
    architecture: String,
    /// The attention kernel the context runs, as [`with_attention_kernel`] labels it.
    attention: String,
    load_ms: f64,
    /// Weight bytes one decoded token reads (`GgufInfo::bytes_per_token`: one embedding row,
    /// the active experts).
    bytes_per_token: u64,
}

impl std::fmt::Debug for LlamaCppBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LlamaCppBackend")
            .field("path", &self.path)
            .field("architecture", &self.architecture)
            .field("n_vocab", &self.n_vocab)
            .field("n_ctx", &self.n_ctx)
            .field("position", &self.position)
            .field("threads", &self.threads)
            .finish()
    }
}

impl LlamaCppBackend {
    /// Validates `path` as GGUF, loads it into llama.cpp and creates a context.
    ///
    /// `FILE_NOT_FOUND` / `FILE_CORRUPTED` come from the GGUF check before llama.cpp sees the
    /// file; `BACKEND_FAILED` when llama.cpp refuses it anyway (e.g. an architecture this
    /// llama.cpp build does not know) or cannot allocate the context; `INPUT_INVALID` for
    /// impossible options.
    pub fn load(path: &Path, opts: &LlamaCppOptions) -> Result<Self> {
        let start = Instant::now();
        let file_architecture = validate_gguf(path)?;
        let bytes_per_token = kylin_loader::read_gguf_info(path)?.bytes_per_token();
        let backend = llama_backend()?;
        let threads = resolve_threads(opts.threads)?;

        let model_params = LlamaModelParams::default().with_n_gpu_layers(0).with_use_mmap(true);
        let model = LlamaModel::load_from_file(backend, path, &model_params).map_err(|e| {
            let arch = file_architecture.as_deref().map(|a| format!(" (architecture '{a}')")).unwrap_or_default();
            KylinError::backend_failed(format!(
                "llama.cpp could not load {}{arch}: {e}; the architecture may be unsupported by \
                 this llama.cpp build, or the file damaged; run with KYLIN_LLAMA_LOG=1 to see why",
                path.display()
            ))
            .at(path)
        })?;
        let model = Box::new(model);

        let n_vocab = usize::try_from(model.n_vocab()).ok().filter(|&n| n > 0).ok_or_else(|| {
            KylinError::backend_failed(format!(
                "llama.cpp reports a vocabulary of {} tokens for {}",
                model.n_vocab(),
                path.display()
            ))
            .at(path)
        })?;
        let n_ctx_train = usize::try_from(model.n_ctx_train()).unwrap_or(0);
        let n_ctx = resolve_ctx(opts.ctx_size, n_ctx_train)?;
        let n_batch = n_ctx.min(MAX_BATCH);

        // Every value below was bounded above: n_ctx <= i32::MAX, n_batch <= 512, threads <= 4096.
        let n_ctx_u32 = std::num::NonZeroU32::new(n_ctx as u32);
        let threads_i32 = threads as i32;
        let ctx_params = LlamaContextParams::default()
            .with_n_ctx(n_ctx_u32)
            .with_n_batch(n_batch as u32)
            .with_n_ubatch(n_batch as u32)
            .with_n_seq_max(1)
            .with_n_threads(threads_i32)
            .with_n_threads_batch(threads_i32)
            .with_flash_attention_policy(opts.flash_attention.policy());
        let (ctx, attention) = with_attention_kernel(opts.flash_attention, || {
            model.new_context(backend, ctx_params).map_err(|e| {
                KylinError::backend_failed(format!(
                    "llama.cpp could not create a context of {n_ctx} tokens for {}: {e}; try a \
                     smaller --ctx-size",
                    path.display()
                ))
                .at(path)
            })
        })?;
        // SAFETY: the context points into the model behind `model`'s box, which is stored in
        // the same struct and declared after `ctx`, so it is dropped after the context; the
        // box is never replaced, and the context is never moved out of the struct.
        let ctx: LlamaContext<'static> = unsafe { std::mem::transmute::<LlamaContext<'_>, LlamaContext<'static>>(ctx) };

        let architecture = model
            .meta_val_str("general.architecture")
            .ok()
            .or(file_architecture)
            .unwrap_or_else(|| "unknown".to_string());
        let chat_template = chat_renderer(&model, n_vocab, opts.chat_template_override.as_deref())?;
        let eos = eog_ids(&model, n_vocab);

        Ok(LlamaCppBackend {
            ctx,
            batch: LlamaBatch::new(n_batch, 1),
            model,
            path: path.to_path_buf(),
            chat_template,
            logits: vec![0.0; n_vocab],
            eos,
            n_vocab,
            n_ctx,
            n_batch,
            position: 0,
            threads,
            architecture,
            attention,
            load_ms: start.elapsed().as_secs_f64() * 1e3,
            bytes_per_token,
        })
    }

    /// Milliseconds spent in [`LlamaCppBackend::load`] (validation, model load, context).
    pub fn load_ms(&self) -> f64 {
        self.load_ms
    }

    /// The GGUF file this backend runs.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Checks that every id is in the vocabulary; llama.cpp must never see one that is not.
    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        match ids.iter().find(|&&id| id as usize >= self.n_vocab) {
            Some(bad) => Err(KylinError::input_invalid(format!(
                "token id {bad} is outside the vocabulary of {} ({} tokens)",
                self.path.display(),
                self.n_vocab
            ))),
            None => Ok(()),
        }
    }

    /// Appends `ids` to the sequence in chunks of at most `n_batch` tokens.
    ///
    /// With `all_logits`, `on_logits(row)` receives the logits of every position in order;
    /// otherwise only the last position's logits are computed, and copied into `self.logits`.
    /// On failure the KV cache is rolled back to where it was.
    fn run(&mut self, ids: &[u32], mut all_logits: Option<&mut Vec<f32>>) -> Result<()> {
        if ids.is_empty() {
            return Err(KylinError::input_invalid("cannot run an empty list of tokens"));
        }
        self.check_ids(ids)?;
        let start = self.position;
        if ids.len() > self.n_ctx - start {
            return Err(KylinError::context_overflow(format!(
                "{} tokens do not fit: {start} already in the context of {} tokens; raise \
                 --ctx-size or shorten the prompt",
                ids.len(),
                self.n_ctx
            )));
        }
        let n_chunks = ids.len().div_ceil(self.n_batch);
        for (c, chunk) in ids.chunks(self.n_batch).enumerate() {
            let last_chunk = c + 1 == n_chunks;
            self.batch.clear();
            for (i, &id) in chunk.iter().enumerate() {
                let want = all_logits.is_some() || (last_chunk && i + 1 == chunk.len());
                // Positions are < n_ctx <= i32::MAX and ids < n_vocab <= i32::MAX (checked).
                let pos = (self.position + i) as i32;
                if let Err(e) = self.batch.add(LlamaToken(id as i32), pos, &[0], want) {
                    self.rollback(start);
                    return Err(KylinError::backend_failed(format!("llama.cpp batch refused a token: {e}")));
                }
            }
            if let Err(e) = self.ctx.decode(&mut self.batch) {
                self.rollback(start);
                return Err(KylinError::backend_failed(format!(
                    "llama.cpp decode of {} tokens at position {} failed for {}: {e}",
                    chunk.len(),
                    self.position,
                    self.path.display()
                ))
                .at(&self.path));
            }
            self.position += chunk.len();
            // `i` indexes the batch; llama.cpp kept logits exactly where they were requested.
            if let Some(out) = all_logits.as_deref_mut() {
                for i in 0..chunk.len() {
                    out.extend_from_slice(self.ctx.get_logits_ith(i as i32));
                }
            } else if last_chunk {
                let row = self.ctx.get_logits_ith((chunk.len() - 1) as i32);
                self.logits.copy_from_slice(row);
            }
        }
        Ok(())
    }

    /// Removes every cached token from position `to` on, after a failed step.
    fn rollback(&mut self, to: usize) {
        // Positions are < n_ctx <= i32::MAX, so the conversion cannot fail.
        let _ = self.ctx.clear_kv_cache_seq(Some(0), Some(to as u32), None);
        self.position = to;
    }
}

impl Backend for LlamaCppBackend {
    fn summary(&self) -> BackendSummary {
        BackendSummary {
            backend: "llama.cpp".to_string(),
            architecture: self.architecture.clone(),
            parameters: self.model.n_params(),
            weight_bytes_per_token: self.bytes_per_token,
            kv_bytes_per_position: None,
            vocab_size: self.n_vocab,
            context_size: self.n_ctx,
            threads: self.threads,
            precision: "ggml".to_string(),
            kernels: kernels_report(&self.attention),
            quantize_ms: None,
        }
    }

    fn eos_ids(&self) -> &[u32] {
        &self.eos
    }

    fn vocab_size(&self) -> usize {
        self.n_vocab
    }

    fn context_size(&self) -> usize {
        self.n_ctx
    }

    fn position(&self) -> usize {
        self.position
    }

    fn tokenize(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        if text.len() > MAX_TEXT_BYTES {
            return Err(KylinError::input_invalid(format!(
                "text of {} bytes is too long to tokenize (limit {MAX_TEXT_BYTES})",
                text.len()
            )));
        }
        // llama.cpp adds BOS (and EOS) only when `add_special` is set and the GGUF's
        // `tokenizer.ggml.add_bos_token` (or the vocabulary type's default) asks for it.
        // Special tokens written in the text (`<|im_start|>`) are parsed as such.
        let tokens = self.model.vocab().tokenize(text.as_bytes(), add_special, true);
        tokens
            .into_iter()
            .map(|LlamaToken(t)| {
                u32::try_from(t).ok().filter(|&t| (t as usize) < self.n_vocab).ok_or_else(|| {
                    KylinError::backend_failed(format!(
                        "llama.cpp tokenizer of {} produced the invalid id {t}",
                        self.path.display()
                    ))
                })
            })
            .collect()
    }

    fn detokenize(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.check_ids(ids)?;
        let vocab = self.model.vocab();
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            // Ids were checked against n_vocab <= i32::MAX above.
            vocab.token_to_piece_into(LlamaToken(id as i32), &mut bytes, !skip_special, None);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Jinja templates see `kwargs` as template variables; llama.cpp's built-in engine (the
    /// fallback) ignores them.
    fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let renderer = self.chat_template.as_ref().ok_or_else(|| {
            KylinError::new(
                ErrorCode::ConfigMissing,
                format!("{} has no chat template (tokenizer.chat_template); pass one explicitly", self.path.display()),
            )
            .at(&self.path)
        })?;
        let template = match renderer {
            ChatRenderer::Jinja(codec) => {
                return codec.apply_chat_template(messages, add_generation_prompt, kwargs);
            }
            ChatRenderer::LlamaCpp(template) => template,
        };
        let total: usize = messages.iter().map(|m| m.role.len() + m.content.len()).sum();
        if total > MAX_TEXT_BYTES {
            return Err(KylinError::input_invalid(format!(
                "conversation of {total} bytes is too long (limit {MAX_TEXT_BYTES})"
            )));
        }
        let chat = messages
            .iter()
            .map(|m| LlamaChatMessage::new(m.role.clone(), m.content.clone()))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| KylinError::input_invalid(format!("a chat message contains a NUL byte: {e}")))?;
        self.model.apply_chat_template(template, &chat, add_generation_prompt).map_err(|e| {
            KylinError::backend_failed(format!(
                "llama.cpp could not apply the chat template of {}: {e}; llama.cpp only knows \
                 well-known templates, pass another with the chat template override",
                self.path.display()
            ))
            .at(&self.path)
        })
    }

    fn reset(&mut self) {
        self.ctx.clear_kv_cache();
        self.position = 0;
    }

    fn rewind(&mut self, len: usize) {
        if len < self.position {
            self.rollback(len);
        }
    }

    fn prefill(&mut self, ids: &[u32]) -> Result<&[f32]> {
        self.run(ids, None)?;
        Ok(&self.logits)
    }

    fn decode(&mut self, id: u32) -> Result<&[f32]> {
        self.run(&[id], None)?;
        Ok(&self.logits)
    }

    fn prefill_all_logits(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        // The size is bounded: ids fit in the context (checked in `run` before any work).
        if ids.len() > self.n_ctx.saturating_sub(self.position) {
            return Err(KylinError::context_overflow(format!(
                "{} tokens do not fit: {} already in the context of {} tokens",
                ids.len(),
                self.position,
                self.n_ctx
            )));
        }
        let mut out = Vec::with_capacity(ids.len() * self.n_vocab);
        self.run(ids, Some(&mut out))?;
        if let Some(last) = out.len().checked_sub(self.n_vocab) {
            self.logits.copy_from_slice(&out[last..]);
        }
        Ok(out)
    }
}

/// Checks the file with Kylin's GGUF reader; returns `general.architecture` when present.
pub(crate) fn validate_gguf(path: &Path) -> Result<Option<String>> {
    if !path.is_file() {
        return Err(KylinError::file_not_found(format!(
            "GGUF file {} does not exist or is not a file",
            path.display()
        ))
        .at(path));
    }
    if path.to_str().is_none() {
        return Err(
            KylinError::input_invalid(format!("llama.cpp needs a UTF-8 path; {} is not one", path.display())).at(path)
        );
    }
    let info = kylin_loader::read_gguf_info(path)?;
    Ok(info.architecture)
}

/// The number of threads to use: `requested`, or every available core when 0.
pub(crate) fn resolve_threads(requested: usize) -> Result<usize> {
    if requested > 4096 {
        return Err(KylinError::input_invalid(format!("{requested} threads requested; at most 4096 are supported")));
    }
    if requested > 0 {
        return Ok(requested);
    }
    Ok(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
}

/// What reports name as llama.cpp's kernels: ggml's CPU features and the attention kernel a
/// context runs (as [`with_attention_kernel`] labels it).
pub(crate) fn kernels_report(attention: &str) -> String {
    format!("{}, attention {attention}", ggml_features())
}

/// The CPU features llama.cpp's ggml was built with, from `llama_print_system_info` (e.g.
/// `ggml: AVX2 AVX512 AVX512_BF16 AMX_INT8`): the `= 1` entries of its CPU section.
pub fn ggml_features() -> String {
    // SAFETY: `llama_print_system_info` returns a pointer to a static NUL-terminated string
    // owned by llama.cpp, valid until the next call; it is copied out at once.
    let info = unsafe {
        let p = llama_cpp_sys_2::llama_print_system_info();
        if p.is_null() { String::new() } else { std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned() }
    };
    let features: Vec<&str> = info
        .split('|')
        .filter_map(|entry| entry.rsplit(':').next()?.trim().strip_suffix("= 1").map(str::trim))
        .filter(|name| !name.is_empty())
        .collect();
    format!("ggml: {}", features.join(" "))
}

/// The KV cache size: the caller's, else `min(n_ctx_train, 4096)`.
fn resolve_ctx(requested: Option<usize>, n_ctx_train: usize) -> Result<usize> {
    match requested {
        Some(0) => Err(KylinError::input_invalid("a context size of 0 tokens is impossible")),
        Some(n) if n > i32::MAX as usize => Err(KylinError::input_invalid(format!(
            "a context size of {n} tokens is larger than llama.cpp supports ({})",
            i32::MAX
        ))),
        Some(n) => Ok(n),
        None if n_ctx_train == 0 => Ok(DEFAULT_MAX_CONTEXT),
        None => Ok(n_ctx_train.min(DEFAULT_MAX_CONTEXT)),
    }
}

/// The ids llama.cpp itself treats as end of generation (EOS, EOT, `<|im_end|>`, ...).
fn eog_ids(model: &LlamaModel, n_vocab: usize) -> Vec<u32> {
    let vocab = model.vocab();
    let mut ids: Vec<u32> = (0..n_vocab as i32).filter(|&t| vocab.is_eog(LlamaToken(t))).map(|t| t as u32).collect();
    // The declared EOS and EOT come first when present, so callers can show "the" EOS.
    for special in [vocab.eot(), vocab.eos()] {
        if let Ok(id) = u32::try_from(special.0)
            && (id as usize) < n_vocab
        {
            ids.retain(|&x| x != id);
            ids.insert(0, id);
        }
    }
    ids
}

/// How a chat conversation becomes a prompt.
enum ChatRenderer {
    /// Kylin's Jinja renderer: what `transformers` renders for the same template.
    Jinja(Box<TextCodec>),
    /// llama.cpp's built-in engine, for templates the Jinja renderer cannot compile and for
    /// llama.cpp template names.
    LlamaCpp(LlamaChatTemplate),
}

/// Picks the chat renderer: the override or the embedded template, through Jinja when it is
/// Jinja and compiles, else through llama.cpp. `None` when there is no template at all.
fn chat_renderer(model: &LlamaModel, n_vocab: usize, override_text: Option<&str>) -> Result<Option<ChatRenderer>> {
    let llama_template = |text: &str| {
        LlamaChatTemplate::new(text)
            .map(ChatRenderer::LlamaCpp)
            .map_err(|_| KylinError::input_invalid("the chat template contains a NUL byte"))
    };
    let is_jinja = |text: &str| text.contains("{%") || text.contains("{{");
    match override_text {
        // A Jinja override that does not compile is the user's error: report it.
        Some(text) if is_jinja(text) => Ok(Some(ChatRenderer::Jinja(Box::new(jinja_codec(model, n_vocab, text)?)))),
        Some(name) => llama_template(name).map(Some),
        None => {
            let Some(text) = model.chat_template(None).ok().and_then(|t| t.to_string().ok()) else {
                return Ok(None);
            };
            match jinja_codec(model, n_vocab, &text) {
                Ok(codec) => Ok(Some(ChatRenderer::Jinja(Box::new(codec)))),
                Err(_) => llama_template(&text).map(Some),
            }
        }
    }
}

/// A [`TextCodec`] used only for its chat template: the GGUF's tokenizer lives in llama.cpp, so
/// the codec gets an empty placeholder tokenizer and the BOS/EOS texts llama.cpp reports.
fn jinja_codec(model: &LlamaModel, n_vocab: usize, template: &str) -> Result<TextCodec> {
    let vocab = model.vocab();
    let special = |token: LlamaToken| {
        let id = u32::try_from(token.0).ok().filter(|&id| (id as usize) < n_vocab)?;
        let bytes = vocab.token_to_piece(token, true, None);
        Some(SpecialToken { content: String::from_utf8_lossy(&bytes).into_owned(), id })
    };
    let bundle = TokenizerBundle {
        tokenizer: tokenizers::Tokenizer::new(tokenizers::models::wordlevel::WordLevel::default()),
        kind: TokenizerKind::TokenizerJson,
        vocab_size: n_vocab,
        bos_token: special(vocab.bos()),
        eos_token: special(vocab.eos()),
        pad_token: None,
        unk_token: None,
        add_bos_token: false,
        add_eos_token: false,
        special_tokens: Vec::new(),
        chat_templates: vec![ChatTemplate { name: "default".into(), source: template.into() }],
    };
    TextCodec::new(&bundle, None)
}
